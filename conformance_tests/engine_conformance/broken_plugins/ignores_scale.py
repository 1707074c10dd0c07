"""Broken: attention recomputes the default softmax scale ``head_dim ** -0.5`` instead of reading
``metadata.scale`` (right for most models, wrong for those with another query scaling, such as Gemma)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class DefaultScaleAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        default = dataclasses.replace(metadata, scale=query.shape[-1] ** -0.5)
        return super().forward(query, key, value, kv_cache, default)


class IgnoresScalePlatform(ReferencePlatform):
    name = "broken-scale"

    def make_attention_backend(self) -> AttentionBackend:
        return DefaultScaleAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [IgnoresScalePlatform]

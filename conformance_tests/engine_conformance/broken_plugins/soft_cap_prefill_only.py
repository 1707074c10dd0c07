"""Broken: the logit soft-cap is applied by the prefill path but forgotten by the decode path.

Imitates a backend whose prefill kernel takes ``logits_soft_cap`` while its separate pure-decode kernel
was never given the argument (Gemma 2 then prefills right and decodes wrong).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class DecodeWithoutCapAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        if metadata.is_pure_decode:
            metadata = dataclasses.replace(metadata, logits_soft_cap=None)
        return super().forward(query, key, value, kv_cache, metadata)


class SoftCapPrefillOnlyPlatform(ReferencePlatform):
    name = "broken-soft-cap"

    def make_attention_backend(self) -> AttentionBackend:
        return DecodeWithoutCapAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [SoftCapPrefillOnlyPlatform]

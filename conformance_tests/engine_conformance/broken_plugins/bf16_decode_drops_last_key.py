"""Broken: the bfloat16 pure-decode fast path stops one key short of the context.

Imitates a decode kernel specialised for bf16 whose loop bound is ``seq_len - 1`` (an exclusive bound
treated as inclusive): every decode query ignores its own, newest key. float32 and any batch with a
prefill row take the general path and are right.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class Bf16DecodeAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        if query.dtype != torch.bfloat16 or not metadata.is_pure_decode:
            return super().forward(query, key, value, kv_cache, metadata)
        # the fast path: the last key is left out (a context of one keeps its only key)
        short = dataclasses.replace(metadata, seq_lens_cpu=[max(1, n - 1) for n in metadata.seq_lens_cpu])
        return super().forward(query, key, value, kv_cache, short)


class Bf16DecodePlatform(ReferencePlatform):
    name = "broken-bf16-decode"

    def make_attention_backend(self) -> AttentionBackend:
        return Bf16DecodeAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [Bf16DecodePlatform]

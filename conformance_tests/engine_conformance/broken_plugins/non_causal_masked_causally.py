"""Broken: attention claims non-causal steps (the reference platform's claims) but masks them causally.

Imitates a backend whose kernel hard-wires the causal mask and never reads ``metadata.causal``: decoder
models run right, while an encoder (BERT, an embedding model, a reranker) gets every token's attention cut
off at its own position, and the last token (the only one a decoder's tests look at) still comes out right.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class AlwaysCausalAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        causal = dataclasses.replace(metadata, causal=True)
        return super().forward(query, key, value, kv_cache, causal)


class NonCausalMaskedCausallyPlatform(ReferencePlatform):
    name = "broken-non-causal"

    def make_attention_backend(self) -> AttentionBackend:
        return AlwaysCausalAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [NonCausalMaskedCausallyPlatform]

"""Broken: attention claims symmetric non-causal windows (the reference platform's claims) but drops the
window whenever a step is not causal.

Imitates a backend whose encoder path is a plain bidirectional SDPA that never reads ``sliding_window``:
BERT-like encoders and ModernBERT's global layers run right, while ModernBERT's local layers let every
token see the whole prompt, which only prompts longer than the window show.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class WindowlessEncoderAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        if not metadata.causal:
            metadata = dataclasses.replace(metadata, sliding_window=None)
        return super().forward(query, key, value, kv_cache, metadata)


class NonCausalWindowIgnoredPlatform(ReferencePlatform):
    name = "broken-non-causal-window"

    def make_attention_backend(self) -> AttentionBackend:
        return WindowlessEncoderAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [NonCausalWindowIgnoredPlatform]

"""Broken: scores over heads wider than 128 use only their first 128 dimensions.

Imitates a kernel whose Q.K tile is fixed at 128 columns while the platform still claims head size 256
(the value product is complete, so outputs look plausible). Heads of 64, 80 and 128 are right.
"""

from __future__ import annotations

from typing import Any

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"

TILE_D = 128


class TruncatedHeadAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        if query.shape[-1] > TILE_D:
            query = query.clone()
            query[..., TILE_D:] = 0  # those dimensions never reach the scores
        return super().forward(query, key, value, kv_cache, metadata)


class HeadDimTruncatedPlatform(ReferencePlatform):
    name = "broken-head-dim"

    def make_attention_backend(self) -> AttentionBackend:
        return TruncatedHeadAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [HeadDimTruncatedPlatform]

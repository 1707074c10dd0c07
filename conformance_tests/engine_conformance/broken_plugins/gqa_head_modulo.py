"""Broken: grouped-query attention maps query head ``h`` to KV head ``h % num_kv_heads`` instead of
``h // (num_heads // num_kv_heads)``.

Imitates the classic GQA indexing slip: right for multi-head attention (one query head per KV head) and
for MQA (one KV head), wrong for every real group.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class ModuloHeadsAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        group = num_heads // num_kv_heads
        heads = torch.arange(num_heads, device=query.device)
        # query head h lands in the slot the reference pairs with KV head h % num_kv_heads
        slot = (heads % num_kv_heads) * group + heads // num_kv_heads
        permuted = torch.empty_like(query)
        permuted[:, slot] = query
        out = super().forward(permuted, key, value, kv_cache, metadata)
        return out[:, slot]


class GqaModuloPlatform(ReferencePlatform):
    name = "broken-gqa-heads"

    def make_attention_backend(self) -> AttentionBackend:
        return ModuloHeadsAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [GqaModuloPlatform]

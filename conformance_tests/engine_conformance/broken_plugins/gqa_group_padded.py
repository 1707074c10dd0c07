"""Broken: a group of query heads that is not a power of two is padded to one before mapping to KV heads.

Imitates a kernel that loads a KV head's query heads with a power-of-two ``tl.arange`` and computes
``kv_head = q_head // next_power_of_2(group)``: groups of 1, 2, 4 and 8 (MHA, MQA, most GQA models) are
right, a group of 3 or 6 (e.g. 12 heads over 4) reads the wrong KV head for some query heads.
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


class PaddedGroupAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        group = num_heads // num_kv_heads
        padded = 1 << (group - 1).bit_length()
        if padded == group:
            return super().forward(query, key, value, kv_cache, metadata)
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        no_write = dataclasses.replace(metadata, slot_mapping=torch.full_like(metadata.slot_mapping, -1))
        out = torch.empty_like(query)
        for kv_head in range(num_kv_heads):
            heads = [h for h in range(num_heads) if min(h // padded, num_kv_heads - 1) == kv_head]
            if heads:
                one = slice(kv_head, kv_head + 1)
                out[:, heads] = super().forward(
                    query[:, heads], key[:, one], value[:, one], kv_cache[:, :, :, one], no_write
                )
        return out


class PaddedGroupPlatform(ReferencePlatform):
    name = "broken-gqa-group"

    def make_attention_backend(self) -> AttentionBackend:
        return PaddedGroupAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [PaddedGroupPlatform]

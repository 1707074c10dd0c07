"""Broken: a block's element offset ``block * block_stride`` is computed in int32 and wraps past 2**31.

Imitates the classic paged-attention overflow: pools up to 2**31 elements read right, larger ones (long
contexts or many sequences on a big device) read the blocks of a wrapped, low address.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class Int32OffsetAttention(ReferenceAttentionBackend):
    block_stride: int = 1

    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        self.block_stride = math.prod(kv_cache.shape[2:])
        return super().forward(query, key, value, kv_cache, metadata)

    def sequence_block_ids(self, metadata: AttentionMetadata, seq: int, num_blocks: int) -> torch.Tensor:
        ids = super().sequence_block_ids(metadata, seq, num_blocks)
        offsets = (ids * self.block_stride) % 2**31  # the int32 product, wrapped (and its sign dropped)
        return offsets // self.block_stride


class Int32OffsetsPlatform(ReferencePlatform):
    name = "broken-int32-offsets"

    def make_attention_backend(self) -> AttentionBackend:
        return Int32OffsetAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [Int32OffsetsPlatform]

"""One-line ValueErrors for attention inputs that do not fit together or point outside the cache."""

from __future__ import annotations

from typing import Any

import torch


def check_slots(max_slot: int, kv_cache: torch.Tensor) -> None:
    """Raise ValueError when a slot lies beyond the cache (index_copy_ would fail less clearly)."""
    capacity = kv_cache.shape[1] * kv_cache.shape[2]
    if max_slot >= capacity:
        raise ValueError(f"slot {max_slot} is outside the KV cache of {capacity} slots")


def check_shapes(query: Any, key: Any, value: Any, kv_cache: Any, block_size: int) -> None:
    """Raise ValueError, in one line, for tensors that do not fit together."""
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError("query, key and value must be [num_tokens, heads, head_dim]")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} shapes differ")
    if query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} disagree on tokens or head_dim"
        )
    if query.shape[1] % key.shape[1] != 0:
        raise ValueError(f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {key.shape[1]}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if (
        kv_cache.shape[2] != block_size
        or kv_cache.shape[3] != key.shape[1]
        or kv_cache.shape[4] != key.shape[2]
    ):
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} does not match block_size {block_size}, "
            f"{key.shape[1]} kv heads, head_dim {key.shape[2]}"
        )

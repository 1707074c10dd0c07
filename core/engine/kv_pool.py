"""Sizing the KV pool: how many blocks the memory budget buys, how many one sequence can hold at once
(less under a sliding window), and the longest sequence the pool fits."""

from __future__ import annotations

from typing import Any

import torch

from engine.config import KV_CACHE_DTYPES, EngineConfig
from engine.errors import EngineConfigError
from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine.interfaces.platform import Platform
from engine.kv_groups import KVGroupLayout
from engine.models.config import ModelConfig

_KV_DTYPES = {name: getattr(torch, name) for name in KV_CACHE_DTYPES}


def longest_fitting_len(config: EngineConfig, windows: list[int | None], max_len: int, num_blocks: int) -> int:
    """``max_len``, or less if one sequence of that length would need more than ``num_blocks`` blocks."""
    def need(length: int) -> int:
        return sum(blocks_per_sequence(config, window, length) for window in windows)

    if need(max_len) <= num_blocks:
        return max_len
    low, high = 1, max_len  # need() grows with the length: the longest that fits, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if need(mid) <= num_blocks else (low, mid - 1)
    return low


def make_kv_pool(
    config: EngineConfig,
    platform: Platform,
    model_config: ModelConfig,
    attention: AttentionBackend,
    layout: KVGroupLayout | None = None,
    model: Any = None,
    extra_bytes_per_block: int = 0,
) -> tuple[BlockCache, int]:
    """The platform's KV pool, sized from the configured budget, and its number of blocks (with KV groups,
    a block spans one group's layers: the pool has ``layout.slots`` layer tensors). A tensor-parallel
    rank's pool holds its own KV heads (``model.num_kv_heads``). ``extra_bytes_per_block`` is what each
    block costs elsewhere out of the same budget (a draft model's pool of as many blocks)."""
    spec = kv_cache_spec(
        config, model_config,
        num_layers=layout.slots if layout is not None else getattr(model, "num_local_layers", model_config.num_layers),
        num_kv_heads=getattr(model, "num_kv_heads", model_config.num_kv_heads),
    )  # fmt: skip
    max_len = config.max_model_len or model_config.max_position_embeddings
    windows = layout.windows if layout is not None else [model_config.sliding_window]
    num_blocks = _num_kv_blocks(config, platform, spec, max_len, windows, extra_bytes_per_block)
    return platform.make_block_cache(spec, num_blocks, attention), num_blocks


def kv_cache_spec(
    config: EngineConfig, model_config: ModelConfig, num_layers: int | None = None, num_kv_heads: int | None = None
) -> KVCacheSpec:
    """The KV blocks' shape for ``model_config`` under ``config`` (its block size and KV dtype); the layer
    and head counts default to the model's."""
    return KVCacheSpec(
        num_layers=model_config.num_layers if num_layers is None else num_layers,
        num_kv_heads=model_config.num_kv_heads if num_kv_heads is None else num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=config.cache.block_size,
        dtype=_KV_DTYPES[config.cache.kv_cache_dtype or config.dtype],
    )


def blocks_per_sequence(config: EngineConfig, window: int | None, max_len: int) -> int:
    """The most blocks one sequence of up to ``max_len`` tokens holds at once.

    Under a sliding window a sequence keeps only the blocks its next step can see: those of the window
    before the step's first token, plus the step's own tokens (up to a whole chunk), plus one for the
    block boundaries the window and the chunk may straddle.
    """
    bs = config.cache.block_size
    whole = -(-max_len // bs)
    if window is None:
        return whole
    step = min(max_len, config.scheduler.max_num_batched_tokens)
    return min(whole, -(-(window - 1 + step) // bs) + 1)


def _num_kv_blocks(
    config: EngineConfig,
    platform: Platform,
    spec: KVCacheSpec,
    max_len: int,
    windows: list[int | None],
    extra_bytes_per_block: int = 0,
) -> int:
    """Blocks in the KV pool: the override, else the memory budget's worth, never more than can be used.

    Raises:
        EngineConfigError: the budget is smaller than one block.
    """
    cache = config.cache
    if cache.num_blocks_override is not None:
        return cache.num_blocks_override
    per_block = spec.bytes_per_block(platform.element_size(spec.dtype)) + extra_bytes_per_block
    budget = cache.kv_cache_memory_bytes or platform.default_kv_cache_bytes()
    if budget is None:
        budget = int(platform.free_memory_bytes() * cache.memory_fraction)
    num_blocks = budget // per_block
    # More blocks than every sequence at full length could use is memory taken for nothing (one more
    # is the null block of a sliding-window model).
    per_sequence = sum(blocks_per_sequence(config, window, max_len) for window in windows)
    reserved = any(window is not None for window in windows)
    useful = config.scheduler.max_num_seqs * per_sequence + reserved
    num_blocks = min(num_blocks, useful)
    if num_blocks < 1:
        raise EngineConfigError(f"the KV cache budget of {budget} bytes is smaller than one block ({per_block} bytes)")
    return num_blocks

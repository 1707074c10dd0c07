"""The SDK's torch block pool over the CPU attention layout: block copies and swaps move exact bytes in
every layer and touch nothing else."""

from __future__ import annotations

import pytest
import torch

from engine_plugin_cpu.attention import CpuAttentionBackend
from engine_plugin_cpu.platform import CpuPlatform
from engine_plugin_sdk import KVCacheSpec, TorchBlockCache


def make_cache(
    dtype: torch.dtype = torch.float32, num_blocks: int = 24, num_host_blocks: int | None = 8
) -> TorchBlockCache:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    cache = TorchBlockCache(spec, num_blocks, CpuAttentionBackend(), num_host_blocks=num_host_blocks)
    gen = torch.Generator().manual_seed(1)
    # random contents (not the zeros it starts with) so a wrong copy cannot match by accident
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen).to(dtype))
    # the host pool is allocated on first use; fill it too, so an untouched host block is recognisable
    cache.host_pool.copy_(torch.randn(cache.host_pool.shape, generator=gen).to(dtype))
    return cache


def test_layout_and_views() -> None:
    cache = make_cache()
    assert cache.num_blocks == 24 and len(cache.kv_caches) == 3
    assert tuple(cache.kv_caches[0].shape) == CpuAttentionBackend().kv_cache_shape(24, 16, 2, 64)
    assert all(layer.is_contiguous() for layer in cache.kv_caches)
    # per-layer tensors are views of the pool, so the attention backend writes land in it
    cache.kv_caches[1][0, 5].fill_(7.0)
    assert torch.all(cache.pool[1, 0, 5] == 7.0)
    assert cache.supports_swap


def test_fresh_cache_is_zeroed() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=32, block_size=8, dtype="bfloat16")
    cache = TorchBlockCache(spec, 10, CpuAttentionBackend())
    assert cache.pool.dtype == torch.bfloat16 and not cache.pool.any()
    assert cache.num_host_blocks == 2  # a quarter of the pool by default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_exact(dtype: torch.dtype) -> None:
    cache = make_cache(dtype)
    before = cache.pool.clone()
    pairs = [(3, 10), (10, 4), (0, 23), (17, 2)]  # 10 is both a source and a destination
    cache.copy_blocks(pairs)
    expected = before.clone()
    for src, dst in pairs:
        expected[:, :, dst] = before[:, :, src]  # all sources are read before any write
    assert torch.equal(cache.pool, expected)


def test_swap_out_and_in_round_trip() -> None:
    cache = make_cache()
    before = cache.pool.clone()
    host_before = cache.host_pool.clone()
    cache.swap_out([(5, 0), (12, 7), (20, 3)])
    assert torch.equal(cache.host_pool[:, :, 0], before[:, :, 5])
    assert torch.equal(cache.host_pool[:, :, 7], before[:, :, 12])
    assert torch.equal(cache.host_pool[:, :, 3], before[:, :, 20])
    untouched = [i for i in range(8) if i not in (0, 7, 3)]
    assert torch.equal(cache.host_pool[:, :, untouched], host_before[:, :, untouched])
    assert torch.equal(cache.pool, before)
    # overwrite the device blocks, then bring the saved copies back into other blocks
    cache.pool[:, :, [5, 12, 20]] = 0
    cache.swap_in([(0, 1), (7, 9), (3, 5)])
    assert torch.equal(cache.pool[:, :, 1], before[:, :, 5])
    assert torch.equal(cache.pool[:, :, 9], before[:, :, 12])
    assert torch.equal(cache.pool[:, :, 5], before[:, :, 20])


def test_empty_requests_are_no_ops() -> None:
    cache = make_cache()
    before = cache.pool.clone()
    cache.copy_blocks([])
    cache.swap_out([])
    cache.swap_in([])
    assert torch.equal(cache.pool, before)


@pytest.mark.parametrize(
    "call, pairs, message",
    [
        ("copy_blocks", [(24, 1)], "source block ids must be in \\[0, 24\\)"),
        ("copy_blocks", [(1, -1)], "destination block ids"),
        ("copy_blocks", [(1, 2), (3, 2)], "more than once"),
        ("swap_out", [(0, 8)], "destination block ids must be in \\[0, 8\\)"),
        ("swap_in", [(9, 0)], "source block ids must be in \\[0, 8\\)"),
    ],
)
def test_bad_block_ids_are_rejected(call: str, pairs: list[tuple[int, int]], message: str) -> None:
    cache = make_cache()
    with pytest.raises(ValueError, match=message):
        getattr(cache, call)(pairs)


def test_platform_factory_builds_the_cache() -> None:
    platform = CpuPlatform()
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    cache = platform.make_block_cache(spec, 40, platform.make_attention_backend())
    assert isinstance(cache, TorchBlockCache) and cache.num_blocks == 40 and cache.num_host_blocks == 10


def test_invalid_sizes_are_rejected() -> None:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="num_blocks must be at least 1"):
        TorchBlockCache(spec, 0, CpuAttentionBackend())
    with pytest.raises(ValueError, match="unknown dtype"):
        TorchBlockCache(KVCacheSpec(1, 1, 64, 16, "float99"), 4, CpuAttentionBackend())

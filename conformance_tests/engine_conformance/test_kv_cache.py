"""The KV cache, exactly: writes by slot mapping, block copies (copy-on-write), swap out and in.

Whatever its layout, a backend's cache is read back through ``AttentionBackend.gather_kv``, so every
check here is bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import KVCacheSpec
from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import assert_equal, default_geometry, torch_dtype
from engine_conformance.pytest_plugin import not_claimed, not_runnable

NUM_BLOCKS = 48
NUM_KV_HEADS = 2
NUM_LAYERS = 2


def gather_all(backend: AttentionBackend, kv_cache: Any, num_blocks: int, capability: str) -> tuple[Any, Any]:
    """Keys and values of every block, ``[num_blocks * block_size, kv_heads, head_dim]`` each."""
    try:
        keys, values = backend.gather_kv(kv_cache, list(range(num_blocks)))
    except NotImplementedError:
        not_runnable(f"{capability} is checked through AttentionBackend.gather_kv, which this backend lacks")
    return keys.clone(), values.clone()


def random_fill(caches: list[Any], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))


def random_fill_pool(backend: AttentionBackend, pool: Any, block_size: int, head_dim: int, seed: int) -> None:
    """Fill every layer of a pool with random keys and values.

    torch caches are filled directly; others (immutable arrays, e.g. JAX) through ``write_kv`` over every
    slot, keeping the cache it returns in ``pool.kv_caches`` (the interface's contract for such arrays).
    """
    if all(isinstance(c, torch.Tensor) for c in pool.kv_caches):
        random_fill(list(pool.kv_caches), seed)
        return
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(NUM_BLOCKS * block_size, dtype=torch.int64)
    for layer in range(len(pool.kv_caches)):
        key, value = (torch.randn(len(slots), NUM_KV_HEADS, head_dim, generator=gen) for _ in range(2))
        dtype = torch_dtype(pool.kv_caches[layer].dtype)
        new = backend.write_kv(key.to(dtype), value.to(dtype), pool.kv_caches[layer], slots)
        if new is not None:
            pool.kv_caches[layer] = new


@pytest.mark.capability("kv_write.{kv_cache_dtype_name}")
def test_write_kv_by_slot_mapping(
    platform: Platform, caps: Capabilities, device: Any, kv_cache_dtype_name: str
) -> None:
    capability = f"kv_write.{kv_cache_dtype_name}"
    geo = default_geometry(caps)
    kv_dtype = torch_dtype(kv_cache_dtype_name)
    backend = platform.make_attention_backend()
    shape = backend.kv_cache_shape(NUM_BLOCKS, geo.block_size, NUM_KV_HEADS, geo.head_size)
    cache = torch.empty(shape, dtype=kv_dtype, device=device)
    random_fill([cache], seed=21)
    keys_before, values_before = gather_all(backend, cache, NUM_BLOCKS, capability)

    gen = torch.Generator().manual_seed(22)
    num_tokens = 3 * geo.block_size + 5
    slots = torch.randperm(NUM_BLOCKS * geo.block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding rows: must not be written anywhere
    key = torch.randn(num_tokens, NUM_KV_HEADS, geo.head_size, generator=gen).to(kv_dtype)
    value = torch.randn(num_tokens, NUM_KV_HEADS, geo.head_size, generator=gen).to(kv_dtype)
    backend.write_kv(key.to(device), value.to(device), cache, slots.to(device))

    keep = slots >= 0
    expected_keys, expected_values = keys_before, values_before
    expected_keys[slots[keep]] = key[keep].to(expected_keys.device)
    expected_values[slots[keep]] = value[keep].to(expected_values.device)
    keys_after, values_after = gather_all(backend, cache, NUM_BLOCKS, capability)
    assert_equal(keys_after, expected_keys, f"{capability} (keys)")
    assert_equal(values_after, expected_values, f"{capability} (values)")


def make_pool(platform: Platform, caps: Capabilities, seed: int) -> tuple[AttentionBackend, Any]:
    geo = default_geometry(caps)
    backend = platform.make_attention_backend()
    spec = KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, geo.head_size, geo.block_size, geo.dtype)
    pool = platform.make_block_cache(spec, NUM_BLOCKS, backend)
    if pool.num_blocks != NUM_BLOCKS or len(pool.kv_caches) != NUM_LAYERS:
        pytest.fail(
            f"block_cache: asked for {NUM_BLOCKS} blocks x {NUM_LAYERS} layers, got {pool.num_blocks} x "
            f"{len(pool.kv_caches)}",
            pytrace=False,
        )
    random_fill_pool(backend, pool, geo.block_size, geo.head_size, seed)
    return backend, pool


def snapshot(backend: AttentionBackend, pool: Any, capability: str) -> list[tuple[Any, Any]]:
    return [gather_all(backend, c, NUM_BLOCKS, capability) for c in pool.kv_caches]


def move_blocks(
    state: list[tuple[Any, Any]], pairs: list[tuple[int, int]], source: list[tuple[Any, Any]], bs: int
) -> None:
    """In ``state``, replace block ``dst`` of every layer with block ``src`` of ``source``."""
    for (keys, values), (src_keys, src_values) in zip(state, source, strict=True):
        for src, dst in pairs:
            keys[dst * bs : (dst + 1) * bs] = src_keys[src * bs : (src + 1) * bs]
            values[dst * bs : (dst + 1) * bs] = src_values[src * bs : (src + 1) * bs]


def assert_pool_equals(
    backend: AttentionBackend, pool: Any, expected: list[tuple[Any, Any]], capability: str, moved: set[int]
) -> None:
    """Every block of every layer equals ``expected``, checked block by block.

    Args:
        moved: the destination blocks of the operation; a difference elsewhere is reported as a write to a
            block that had to stay untouched.
    """
    bs = expected[0][0].shape[0] // NUM_BLOCKS
    for layer, (cache, (keys, values)) in enumerate(zip(pool.kv_caches, expected, strict=True)):
        got_keys, got_values = gather_all(backend, cache, NUM_BLOCKS, capability)
        for block in range(NUM_BLOCKS):
            rows = slice(block * bs, (block + 1) * bs)
            role = "destination block" if block in moved else "untouched block"
            assert_equal(got_keys[rows], keys[rows], f"{capability} (layer {layer} keys, {role} {block})")
            assert_equal(
                got_values[rows], values[rows], f"{capability} (layer {layer} values, {role} {block})"
            )


#: copy-on-write batches of 1, 2, 3 and 5 pairs, unsorted; one source forks into two destinations
COPY_ROUNDS = (
    [(29, 4)],
    [(40, 3), (2, 33)],
    [(45, 12), (6, 47), (45, 0)],
    [(31, 9), (1, 44), (27, 18), (13, 37), (46, 22)],
)
#: swap batches of (device block out, host block, device block in): 1, 2, 3 and 5, unsorted, scattered
#: host ids (the host pool is NUM_BLOCKS // 4 blocks, as the default pools make it)
SWAP_ROUNDS = (
    [(7, 9, 30)],
    [(40, 2, 5), (3, 11, 41)],
    [(33, 6, 7), (20, 0, 21), (8, 10, 9)],
    [(44, 3, 12), (1, 8, 46), (25, 1, 25), (17, 11, 2), (36, 5, 30)],
)


@pytest.mark.capability("block_cache.copy")
def test_copy_blocks(platform: Platform, caps: Capabilities) -> None:
    backend, pool = make_pool(platform, caps, seed=31)
    bs = default_geometry(caps).block_size
    state = snapshot(backend, pool, "block_cache.copy")
    for pairs in COPY_ROUNDS:
        pool.copy_blocks(pairs)
        expected = [(k.clone(), v.clone()) for k, v in state]
        move_blocks(expected, pairs, state, bs)
        assert_pool_equals(
            backend, pool, expected, f"block_cache.copy ({len(pairs)} pairs)", {d for _, d in pairs}
        )
        state = expected


@pytest.mark.capability("block_cache.swap")
def test_swap_out_and_in(platform: Platform, caps: Capabilities, record_property: Any) -> None:
    backend, pool = make_pool(platform, caps, seed=41)
    if not caps.swap:
        if pool.supports_swap:
            pytest.fail("block_cache.swap: not claimed, but BlockCache.supports_swap is true", pytrace=False)
        record_property("not_claimed", "supports_swap is false")
        not_claimed("swapping blocks to host memory")
    if not pool.supports_swap:
        pytest.fail("block_cache.swap: claimed, but BlockCache.supports_swap is false", pytrace=False)
    host_needed = 1 + max(host for round_ in SWAP_ROUNDS for _, host, _ in round_)
    if pool.num_host_blocks < host_needed:
        not_runnable(
            f"the check swaps to host block ids up to {host_needed - 1}; this pool has {pool.num_host_blocks}"
        )
    geo = default_geometry(caps)
    for round_index, triples in enumerate(SWAP_ROUNDS):
        capability = f"block_cache.swap ({len(triples)} pairs)"
        original = snapshot(backend, pool, capability)
        pool.swap_out([(out, host) for out, host, _ in triples])
        # the device blocks are reused by other sequences meanwhile
        random_fill_pool(backend, pool, geo.block_size, geo.head_size, seed=42 + round_index)
        overwritten = snapshot(backend, pool, capability)
        # back in the reverse order: pairs need not come in the order they went out
        pool.swap_in([(host, back) for _, host, back in reversed(triples)])
        expected = [(k.clone(), v.clone()) for k, v in overwritten]
        move_blocks(expected, [(out, back) for out, _, back in triples], original, geo.block_size)
        assert_pool_equals(backend, pool, expected, capability, {back for _, _, back in triples})

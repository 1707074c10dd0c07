"""Cache offsets beyond 32 bits: writes and attention on blocks past element 2**31 (see large_offsets.py).

Both checks read what was written back through ``gather_kv``, bit for bit, so a write that wrapped to a
low block, or a read that came from one, fails even where the wrapped address happened to be mapped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import assert_close, assert_equal
from engine_conformance.large_offsets import LargeCache, allocate, host_peak_bytes, host_peak_reset, plan
from engine_conformance.pytest_plugin import not_runnable
from engine_plugin_sdk.problems import make_attention_problem

#: blocks the write check fills (the top of the pool)
WRITE_BLOCKS = 8


def gather(backend: AttentionBackend, kv_cache: Any, blocks: list[int], capability: str) -> tuple[Any, Any]:
    """Keys and values of some blocks, on the host."""
    try:
        keys, values = backend.gather_kv(kv_cache, blocks)
    except NotImplementedError:
        not_runnable(f"{capability} is checked through AttentionBackend.gather_kv, which this backend lacks")
    return keys.cpu().clone(), values.cpu().clone()


def record_peak(record_property: Any, cache: LargeCache, measured: bool) -> None:
    """Report the host memory the check took next to the cache's size (a backend that touched every page
    of a host cache would show it here)."""
    peak = host_peak_bytes() if measured else None
    record_property("cache_gib", round(cache.total_bytes / 2**30, 2))
    if peak is not None:
        record_property("host_peak_rss_mib", round(peak / 2**20))


@pytest.mark.capability("kv_write.large_block_index")
def test_write_kv_beyond_32_bits(
    platform: Platform, caps: Capabilities, tmp_path: Path, record_property: Any
) -> None:
    """``write_kv`` into the top blocks of a >2**31-element cache: every slot lands where it belongs."""
    capability = "kv_write.large_block_index"
    backend = platform.make_attention_backend()
    cache = plan(backend, caps)
    measured = host_peak_reset()
    kv_cache = allocate(platform, cache, tmp_path)
    device = platform.torch_device()
    # the last few blocks: each written slot is one program in Triton's interpreter
    top = cache.top_blocks[-WRITE_BLOCKS:]
    bs, d = cache.block_size, cache.head_dim
    slots = torch.tensor([b * bs + i for b in top for i in range(bs)], dtype=torch.int64)
    # zeros first (a device cache starts as garbage), then random values into a random subset of slots
    zeros = torch.zeros(len(slots), 1, d, dtype=cache.dtype)
    new = backend.write_kv(zeros.to(device), zeros.to(device), kv_cache, slots.to(device))
    kv_cache = kv_cache if new is None else new
    gen = torch.Generator().manual_seed(121)
    chosen = torch.randperm(len(slots), generator=gen)[: len(slots) // 3]
    key = torch.randn(len(chosen), 1, d, generator=gen).to(cache.dtype)
    value = torch.randn(len(chosen), 1, d, generator=gen).to(cache.dtype)
    written = slots[chosen].clone()
    written[::5] = -1  # padding rows: written nowhere
    new = backend.write_kv(key.to(device), value.to(device), kv_cache, written.to(device))
    kv_cache = kv_cache if new is None else new
    keep = written >= 0
    expected_keys, expected_values = zeros.clone(), zeros.clone()
    expected_keys[chosen[keep]] = key[keep]
    expected_values[chosen[keep]] = value[keep]
    got_keys, got_values = gather(backend, kv_cache, top, capability)
    assert_equal(got_keys, expected_keys, f"{capability} (keys of blocks {top[0]}..{top[-1]})")
    assert_equal(got_values, expected_values, f"{capability} (values of blocks {top[0]}..{top[-1]})")
    record_peak(record_property, cache, measured)


@pytest.mark.capability("attention.large_block_index")
def test_attention_beyond_32_bits(
    platform: Platform, caps: Capabilities, tmp_path: Path, record_property: Any
) -> None:
    """A prefill chunk and a decode over blocks past element 2**31: the output within tolerance, the cached
    prefix read back bit for bit."""
    capability = "attention.large_block_index"
    backend = platform.make_attention_backend()
    cache = plan(backend, caps)
    measured = host_peak_reset()
    kv_cache = allocate(platform, cache, tmp_path)
    problem = make_attention_problem(
        2, [1, 6], [40, 70], 2, 1, cache.head_dim, cache.block_size, cache.num_blocks,
        dtype=cache.dtype, device=platform.torch_device(), seed=12, block_pool=cache.top_blocks,
    )  # fmt: skip
    out = problem.run(backend, kv_cache)
    assert_close(out, problem.reference_output(), problem.tolerance(), capability)
    for seq, (table, q_len, ctx) in enumerate(
        zip(problem.block_tables, problem.query_lens, problem.seq_lens, strict=True)
    ):
        cached = ctx - q_len
        keys, values = gather(backend, kv_cache, table, capability)
        label = f"{capability} (sequence {seq}'s cached prefix, blocks {table})"
        want_keys = problem.key_history[seq][:cached].to(problem.kv_cache_dtype)
        want_values = problem.value_history[seq][:cached].to(problem.kv_cache_dtype)
        assert_equal(keys[:cached], want_keys, f"{label} keys")
        assert_equal(values[:cached], want_values, f"{label} values")
    record_peak(record_property, cache, measured)

"""CPU paged attention against a float64 per-sequence softmax over the keys and values that were written."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from amx_test_kernels import amx_kernels

from engine_plugin_cpu.attention import ENCODER_STARTS_KEY, PLAN_KEY, CpuAttentionBackend
from engine_plugin_cpu.attention_plan import ChunkBudget, bucket_by_length
from engine_plugin_sdk import AttentionMetadata

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass
class Batch:
    """One step's inputs plus the original per-sequence keys/values for the reference."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata
    full_keys: list[torch.Tensor]
    full_values: list[torch.Tensor]
    query_lens: list[int]
    seq_lens: list[int]


def make_batch(
    backend: CpuAttentionBackend,
    shapes: list[tuple[int, int]],
    num_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    causal: bool = True,
    spare_blocks: int = 37,
    seed: int = 0,
    layout_seed: int | None = None,
) -> Batch:
    """Sequences given as ``(prefix_len, query_len)``; prefixes are written to the cache beforehand.

    Blocks are assigned from a shuffled pool with spare blocks of noise, so a read through the wrong
    slot cannot go unnoticed.
    """
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    seq_lens = [p + q for p, q in shapes]
    query_lens = [q for _, q in shapes]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    kv_cache = torch.randn(
        backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=gen
    ).to(cache_dtype)
    layout_gen = torch.Generator().manual_seed(seed if layout_seed is None else layout_seed)
    order = torch.randperm(num_blocks, generator=layout_gen).tolist()
    width = max(blocks_per_seq) + 3
    block_tables = torch.zeros(len(shapes), width, dtype=torch.int32)
    tables: list[list[int]] = []
    for i, n in enumerate(blocks_per_seq):
        ids, order = order[:n], order[n:]
        tables.append(ids)
        block_tables[i, :n] = torch.tensor(ids, dtype=torch.int32)

    def slot(seq: int, pos: int) -> int:
        return tables[seq][pos // block_size] * block_size + pos % block_size

    full_keys, full_values = [], []
    new_q, new_k, new_v, new_slots = [], [], [], []
    for i, (prefix, qlen) in enumerate(shapes):
        n = prefix + qlen
        # round-trip through the dtypes so the float64 reference sees exactly what the kernel sees
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype).to(cache_dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype).to(cache_dtype)
        full_keys.append(k.double())
        full_values.append(v.double())
        if prefix:
            backend.write_kv(
                k[:prefix], v[:prefix], kv_cache, torch.tensor([slot(i, p) for p in range(prefix)])
            )
        new_q.append(torch.randn(qlen, num_heads, head_dim, generator=gen).to(dtype))
        new_k.append(k[prefix:].to(dtype))
        new_v.append(v[prefix:].to(dtype))
        new_slots.extend(slot(i, p) for p in range(prefix, n))
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        scale=head_dim**-0.5,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
    )
    return Batch(
        torch.cat(new_q),
        torch.cat(new_k),
        torch.cat(new_v),
        kv_cache,
        metadata,
        full_keys,
        full_values,
        query_lens,
        seq_lens,
    )


def reference_attention(batch: Batch) -> torch.Tensor:
    """Float64 softmax attention, one sequence at a time, from the original keys and values."""
    md = batch.metadata
    outs = []
    start = 0
    for i, qlen in enumerate(batch.query_lens):
        q = batch.query[start : start + qlen].double()
        start += qlen
        k, v = batch.full_keys[i], batch.full_values[i]
        n = k.shape[0]
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * md.scale
        if md.logits_soft_cap is not None:
            scores = md.logits_soft_cap * torch.tanh(scores / md.logits_soft_cap)
        q_pos = torch.arange(n - qlen, n).view(-1, 1)
        k_pos = torch.arange(n).view(1, -1)
        visible = torch.ones(qlen, n, dtype=torch.bool)
        if md.causal:
            visible &= k_pos <= q_pos
        if md.sliding_window is not None:
            visible &= k_pos > q_pos - md.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v))
    return torch.cat(outs)


def check(backend: CpuAttentionBackend, batch: Batch, dtype: torch.dtype = torch.float32) -> None:
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=tol, rtol=tol)


DTYPES = [torch.float32, torch.bfloat16]
DECODE = [(40, 1), (200, 1), (3, 1), (129, 1), (0, 1)]
PREFILL = [(0, 37), (0, 5), (0, 64)]
CHUNKED = [(48, 20), (33, 7), (100, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize(
    "shapes",
    [DECODE, PREFILL, CHUNKED, DECODE + PREFILL + CHUNKED],
    ids=["decode", "prefill", "chunked", "mixed"],
)
def test_batch_kinds(dtype: torch.dtype, heads: tuple[int, int], shapes: list[tuple[int, int]]) -> None:
    backend = CpuAttentionBackend()
    check(backend, make_batch(backend, shapes, num_heads=heads[0], num_kv_heads=heads[1], dtype=dtype), dtype)


def test_mixed_batch_interleaved_order() -> None:
    # decode rows scattered between prefills, so their rows are not 0..D-1
    shapes = [(0, 9), (70, 1), (20, 12), (5, 1), (0, 3), (31, 1)]
    backend = CpuAttentionBackend()
    check(backend, make_batch(backend, shapes, seed=3))


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_head_and_block_sizes(head_dim: int, block_size: int) -> None:
    backend = CpuAttentionBackend()
    shapes = [(45, 1), (0, 19), (70, 9), (130, 1)]
    check(
        backend,
        make_batch(backend, shapes, head_dim=head_dim, block_size=block_size, seed=head_dim + block_size),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 7, 32, 1000])
def test_sliding_window(dtype: torch.dtype, window: int) -> None:
    backend = CpuAttentionBackend()
    shapes = [(90, 1), (5, 1), (0, 40), (60, 25)]
    check(backend, make_batch(backend, shapes, dtype=dtype, sliding_window=window, seed=window), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_soft_cap(dtype: torch.dtype) -> None:
    backend = CpuAttentionBackend()
    shapes = DECODE + PREFILL + CHUNKED
    # a small cap so that it visibly changes the result
    check(backend, make_batch(backend, shapes, dtype=dtype, soft_cap=2.0, seed=11), dtype)


def test_not_causal() -> None:
    backend = CpuAttentionBackend()
    check(backend, make_batch(backend, [(0, 12), (30, 6), (17, 1)], causal=False, seed=5))


def test_not_causal_whole_prompts_leave_the_cache_alone() -> None:
    """An encoder's step (whole prompts, no prefix) attends to its own rows; its keys and values are never
    read again, so the cache stays as it was, while a non-causal step over a cached prefix still writes."""
    backend = CpuAttentionBackend()
    batch = make_batch(backend, [(0, 12), (0, 12), (0, 7)], causal=False, seed=6)
    before = batch.kv_cache.clone()
    check(backend, batch)
    assert torch.equal(batch.kv_cache, before)
    prefixed = make_batch(backend, [(0, 12), (30, 6)], causal=False, seed=7)
    before = prefixed.kv_cache.clone()
    check(backend, prefixed)
    assert not torch.equal(prefixed.kv_cache, before)


@pytest.mark.parametrize("use_flash", [True, False], ids=["flash", "matmul"])
@pytest.mark.parametrize(
    "features",
    [{}, {"sliding_window": 20}, {"soft_cap": 3.0}, {"sliding_window": 9, "soft_cap": 5.0}],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_many_chunks(use_flash: bool, features: dict, dtype: torch.dtype) -> None:
    # two blocks per chunk forces the online softmax across chunks, including chunks a row cannot see
    backend = CpuAttentionBackend(budget=ChunkBudget(max_blocks=2), use_flash=use_flash)
    shapes = [(150, 1), (2, 1), (77, 1), (0, 50), (64, 30), (33, 1)]
    check(backend, make_batch(backend, shapes, block_size=8, dtype=dtype, seed=7, **features), dtype)


def test_many_blocks_random_tables() -> None:
    # long contexts over a large shuffled pool catch index arithmetic that overflows or wraps
    backend = CpuAttentionBackend()
    shapes = [(1500, 1), (700, 1), (900, 40), (0, 300), (2047, 1)]
    check(backend, make_batch(backend, shapes, block_size=8, spare_blocks=3000, seed=13))


def test_plan_reused_across_layers() -> None:
    backend = CpuAttentionBackend()
    shapes = [(40, 1), (0, 10), (25, 6)]
    first = make_batch(backend, shapes, seed=21)
    check(backend, first)
    # a second "layer": same metadata object, different cache and inputs with the same prefix layout
    second = make_batch(backend, shapes, seed=22, layout_seed=21)
    second.metadata = first.metadata
    check(backend, second)


def test_cache_dtype_differs_from_model_dtype() -> None:
    backend = CpuAttentionBackend()
    batch = make_batch(backend, DECODE + CHUNKED, dtype=torch.float32, cache_dtype=torch.bfloat16, seed=2)
    check(backend, batch)


def test_forward_writes_new_tokens_to_their_slots() -> None:
    backend = CpuAttentionBackend()
    batch = make_batch(backend, [(10, 1), (0, 20), (30, 5)], seed=4)
    backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    flat = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[3:])
    slots = batch.metadata.slot_mapping
    assert torch.equal(flat[0, slots], batch.key)
    assert torch.equal(flat[1, slots], batch.value)


def test_write_kv_shuffled_slots_and_skipped_negatives() -> None:
    backend = CpuAttentionBackend()
    gen = torch.Generator().manual_seed(8)
    cache = torch.randn(backend.kv_cache_shape(12, 16, 2, 64), generator=gen)
    before = cache.clone()
    num_tokens = 50
    slots = torch.randperm(12 * 16, generator=gen)[:num_tokens]
    skipped = torch.tensor([3, 17, 18, 49])
    slots[skipped] = -1
    key = torch.randn(num_tokens, 2, 64, generator=gen)
    value = torch.randn(num_tokens, 2, 64, generator=gen)
    backend.write_kv(key, value, cache, slots)
    flat, flat_before = cache.view(2, -1, 2, 64), before.view(2, -1, 2, 64)
    kept = slots >= 0
    assert torch.equal(flat[0, slots[kept]], key[kept])
    assert torch.equal(flat[1, slots[kept]], value[kept])
    untouched = torch.ones(12 * 16, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


def test_gather_kv_returns_written_tokens() -> None:
    backend = CpuAttentionBackend()
    cache = torch.randn(backend.kv_cache_shape(10, 8, 3, 64))
    key, value = torch.randn(16, 3, 64), torch.randn(16, 3, 64)
    blocks = [7, 2]
    slots = torch.tensor([b * 8 + i for b in blocks for i in range(8)])
    backend.write_kv(key, value, cache, slots)
    k, v = backend.gather_kv(cache, blocks)
    assert torch.equal(k, key) and torch.equal(v, value)


def test_rejects_head_count_mismatch() -> None:
    backend = CpuAttentionBackend()
    batch = make_batch(backend, [(5, 1)], num_heads=8, num_kv_heads=4)
    with pytest.raises(ValueError, match="not a multiple"):
        backend.forward(
            batch.query[:, :6], batch.key[:, :4], batch.value[:, :4], batch.kv_cache, batch.metadata
        )


def test_rejects_narrow_block_table() -> None:
    backend = CpuAttentionBackend()
    batch = make_batch(backend, [(40, 1)])
    batch.metadata.block_tables = batch.metadata.block_tables[:, :2]
    with pytest.raises(ValueError, match="block_tables has 2 columns"):
        backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)


def test_rejects_query_length_mismatch() -> None:
    backend = CpuAttentionBackend()
    batch = make_batch(backend, [(0, 8)])
    with pytest.raises(ValueError, match="query lengths sum to 8"):
        backend.forward(batch.query[:5], batch.key[:5], batch.value[:5], batch.kv_cache, batch.metadata)


def test_thread_count_restored_after_small_batch() -> None:
    original = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        backend = CpuAttentionBackend()
        check(backend, make_batch(backend, [(20, 1)], seed=30))
        assert torch.get_num_threads() == 2
        # a rejected call leaves the setting alone too
        batch = make_batch(backend, [(0, 8)], seed=31)
        with pytest.raises(ValueError):
            backend.forward(batch.query, batch.key[:, :1], batch.value[:, :1], batch.kv_cache, batch.metadata)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(original)


def test_decode_lengths_far_apart_are_bucketed() -> None:
    backend = CpuAttentionBackend()
    shapes = [(3000, 1), (4, 1), (0, 6), (9, 1), (3500, 1), (7, 1), (2600, 1)]
    batch = make_batch(backend, shapes, block_size=16, seed=17)
    check(backend, batch)
    plan = batch.metadata.extras[PLAN_KEY]
    groups = sorted(sorted(batch.metadata.seq_lens_cpu[i] for i in g) for g in bucket_ids(plan, batch))
    assert groups == [[5, 8, 10], [2601, 3001, 3501]]


def bucket_ids(plan, batch: Batch) -> list[list[int]]:
    """Sequence indices of each decode group, recovered from its token rows."""
    starts = batch.metadata.query_start_loc.tolist()
    out = []
    for group in plan.decode:
        rows = list(range(group.num_seqs)) if group.rows is None else group.rows.tolist()
        out.append([starts.index(r) for r in rows])
    return out


def test_bucket_by_length_keeps_order_for_one_bucket() -> None:
    assert bucket_by_length([0, 1, 2], [30, 10, 20]) == [[0, 1, 2]]
    assert bucket_by_length([], []) == []
    assert bucket_by_length([0, 1, 2, 3], [5000, 3, 4000, 2], min_tokens=100) == [[3, 1], [2, 0]]


def test_workspace_survives_inference_mode_and_growth() -> None:
    backend = CpuAttentionBackend()
    with torch.inference_mode():
        check(backend, make_batch(backend, [(20, 1), (40, 1)], seed=40))
    # larger gathers than before (the buffer grows), now outside inference mode
    check(backend, make_batch(backend, [(300, 1), (0, 5), (90, 4), (250, 1)], seed=41))
    check(backend, make_batch(backend, [(10, 1)], seed=42))


def test_rejects_slot_outside_cache() -> None:
    backend = CpuAttentionBackend()
    batch = make_batch(backend, [(3, 2)], spare_blocks=0)
    capacity = batch.kv_cache.shape[1] * batch.kv_cache.shape[2]
    batch.metadata.slot_mapping = torch.tensor([0, capacity])
    with pytest.raises(ValueError, match=f"slot {capacity} is outside the KV cache"):
        backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    with pytest.raises(ValueError, match="outside the KV cache"):
        backend.write_kv(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)


def test_equal_length_prefills_batched_into_one_call_match_the_reference():
    """Several plain prompts of the same length (one SDPA call) next to one of another length."""
    import random

    from engine_plugin_cpu.attention import CpuAttentionBackend

    torch.manual_seed(5)
    rng = random.Random(5)
    heads, kv_heads, dim, bs, num_blocks = 4, 2, 64, 16, 64
    lengths = [7, 7, 7, 12]
    backend = CpuAttentionBackend()
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, bs, kv_heads, dim))
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots = [], []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // bs))]
        tables.append(table + [0] * (2 - len(table)))
        slots += [table[p // bs] * bs + p % bs for p in range(n)]
    total = sum(lengths)
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_lens_cpu=lengths, seq_lens_cpu=lengths, max_query_len=12, max_seq_len=12, block_size=bs, scale=dim**-0.5,
    )
    out = backend.forward(q, k, v, cache, meta)
    for s, n in zip(starts, lengths):
        qd, kd, vd = (t[s : s + n].double() for t in (q, k, v))
        kd, vd = kd.repeat_interleave(heads // kv_heads, 1), vd.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", qd, kd) * dim**-0.5
        scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd)
        torch.testing.assert_close(out[s : s + n].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_short_rows_run_in_the_c_decode_kernel_one_row_a_token(window: int | None) -> None:
    """A bf16 step whose rows bring a few tokens each (speculative verification) runs each token as a
    decode row of the C kernel: the same attention, causal within a row, the new keys and values stored."""
    from engine_plugin_cpu.native_build import load_native
    from engine_plugin_cpu.native_decode import NATIVE_SHORT_ROWS_KEY
    from engine_plugin_cpu.native_kernels import NativeKernels

    loaded = load_native()
    if loaded.lib is None:
        pytest.skip(f"C kernels unavailable: {loaded.reason}")
    native = NativeKernels(loaded.lib, threads=2)
    try:
        backend = CpuAttentionBackend(native=native)
        shapes = [(40, 5), (3, 2), (130, 5), (0, 4), (17, 1)]
        batch = make_batch(backend, shapes, dtype=torch.bfloat16, sliding_window=window, seed=21)
        check(backend, batch, torch.bfloat16)
        tables, lengths, total = batch.metadata.extras[NATIVE_SHORT_ROWS_KEY]
        assert lengths.tolist() == [41, 42, 43, 44, 45, 4, 5, 131, 132, 133, 134, 135, 1, 2, 3, 4, 18]
        assert total == sum(lengths.tolist()) and tables.shape[0] == len(lengths)
        # the step's new keys sit in the cache where the prefill path would have put them
        flat = batch.kv_cache[0].reshape(-1, *batch.key.shape[1:])
        assert torch.equal(flat[batch.metadata.slot_mapping], batch.key)
    finally:
        native.close()


@pytest.mark.parametrize("heads", [(12, 12), (8, 2)], ids=["mha", "gqa"])
def test_an_encoder_step_runs_on_the_amx_tiles(heads: tuple[int, int]) -> None:
    """A bf16 step of whole prompts goes to the kernel (its offsets cached for the step) and matches the
    float64 reference; a step with a cached prefix keeps the general path."""
    kernels = amx_kernels()
    backend = CpuAttentionBackend(native=next(kernels))
    batch = make_batch(backend, [(0, 40), (0, 7), (0, 64)], num_heads=heads[0], num_kv_heads=heads[1],
                       head_dim=32, dtype=torch.bfloat16, causal=False, seed=3)  # fmt: skip
    check(backend, batch, torch.bfloat16)
    starts, longest = batch.metadata.extras[ENCODER_STARTS_KEY][1]
    assert starts.tolist() == [0, 40, 47, 111] and longest == 64
    prefixed = make_batch(backend, [(0, 12), (30, 6)], num_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
                          dtype=torch.bfloat16, causal=False, seed=4)  # fmt: skip
    check(backend, prefixed, torch.bfloat16)
    assert ENCODER_STARTS_KEY not in prefixed.metadata.extras
    kernels.close()

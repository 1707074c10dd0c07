"""The decode attention kernel (and its launcher's choices) against float64 references and against itself, on
small shapes (interpreter on the CPU): split contexts and their merges, the step's own KV written by the kernel,
two KV heads a program, the early read under PDL, graph padding rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from attention_cases import DECODE_LENS, check, filled_problem, tuning

from engine_plugin_sdk.gpu.triton_kernels import KernelTuning, launchers
from engine_plugin_sdk.gpu.triton_kernels.l2_prefetch import l2_share_args
from engine_plugin_sdk.problems import make_attention_problem
from engine_plugin_sdk.reference_ops import make_cos_sin_cache


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("feature", ["plain", "window", "soft_cap"])
def test_decode_split_context(device, splits, feature):
    kw = {"sliding_window": 12} if feature == "window" else {"soft_cap": 2.0} if feature == "soft_cap" else {}
    problem, cache = filled_problem(device, torch.float16, DECODE_LENS, seed=splits, **kw)
    md = problem.metadata
    out = torch.full_like(problem.query, float("nan"))
    launchers.paged_decode(
        out, problem.query, cache, md.block_tables, md.seq_lens, md.scale, splits, tuning(),
        window=md.sliding_window, soft_cap=md.logits_soft_cap,
    )  # fmt: skip
    check(out, problem, f"decode splits={splits} {feature}")


@pytest.mark.parametrize(("splits", "min_keys"), [(8, 0), (16, 0), (8, 40)])
@pytest.mark.parametrize("window", [None, 12])
def test_decode_merges_only_the_splits_that_hold_keys(device, splits, min_keys, window, monkeypatch):
    """A graph's split count is fixed for any context: splits past a short context's end write no partials
    and the merge must not read them. The partial buffers start as NaN here, so a merge that read an
    unwritten split would give NaN. With ``decode_min_split_keys`` (40: three of the interpreter's 16-key
    tiles a split) the 97-key context takes three splits of 48 keys, not seven of 16."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    problem, cache = filled_problem(device, torch.float16, DECODE_LENS, seed=60 + splits, sliding_window=window)
    md = problem.metadata
    out = torch.full_like(problem.query, float("nan"))
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", nan_empty)
        launchers.paged_decode(
            out, problem.query, cache, md.block_tables, md.seq_lens, md.scale, splits,
            dataclasses.replace(tuning(), decode_min_split_keys=min_keys), window=window,
        )  # fmt: skip
    check(out, problem, f"decode splits={splits} min keys={min_keys} window={window}, most splits idle")


@pytest.mark.parametrize(
    ("splits", "min_keys", "lens", "window"),
    [(2, 0, DECODE_LENS, 12), (8, 0, DECODE_LENS, 12), (4, 32, DECODE_LENS, 12), (16, 0, ([1, 1, 1], [3, 150, 230]), None)],
)
def test_decode_last_split_merges_when_given_arrival_counts(device, splits, min_keys, lens, window):
    """With ``arrivals`` the split programs that hold keys count themselves and the last of each KV head's merges
    its heads (no merge kernel; the idle splits past a short context leave at once, uncounted; more than 8 splits
    with keys, joined in two chunks): the same result as the merge kernel's, and every count back at zero (with
    ``decode_min_split_keys`` too)."""
    problem, cache = filled_problem(device, torch.float16, lens, seed=40 + splits, sliding_window=window)
    md = problem.metadata
    outs = []
    arrivals = torch.zeros(64, dtype=torch.int32, device=device)
    for given in (None, arrivals, arrivals):
        out = torch.full_like(problem.query, float("nan"))
        launchers.paged_decode(
            out, problem.query, cache, md.block_tables, md.seq_lens, md.scale, splits,
            dataclasses.replace(tuning(), decode_min_split_keys=min_keys), window=md.sliding_window, arrivals=given,
        )  # fmt: skip
        outs.append(out)
        assert not arrivals.any()
    check(outs[1], problem, f"decode splits={splits} merged by the last split")
    # the last split joins its heads' splits a chunk at a time: sums in another order than the merge kernel's
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-3, atol=1e-3)
    assert torch.equal(outs[1], outs[2])


def test_decode_large_head_tiles(device):
    """Head size 256 through the decode kernel with the large-head tiles (32 keys per iteration, as the
    NVIDIA table gives them), split and unsplit, windowed and soft-capped as Gemma's layers are."""
    import dataclasses

    large = dataclasses.replace(tuning(), decode_large_head=(32, 4, 2))
    for splits, kw in ((1, {}), (4, {"sliding_window": 12, "soft_cap": 2.0})):
        problem, cache = filled_problem(device, torch.float16, DECODE_LENS, head_dim=256, seed=5 + splits, **kw)
        md = problem.metadata
        out = torch.full_like(problem.query, float("nan"))
        launchers.paged_decode(
            out, problem.query, cache, md.block_tables, md.seq_lens, md.scale, splits, large,
            window=md.sliding_window, soft_cap=md.logits_soft_cap,
        )  # fmt: skip
        check(out, problem, f"decode head 256, block_n 32, splits={splits}")



@pytest.mark.parametrize(
    ("heads", "feature", "splits"),
    [(8, "plain", 1), (16, "rotary_head_norm", 1), (16, "window_cap", 4), (8, "sinks", 4), (16, "merge_last", 2)],
)
def test_decode_two_kv_heads_a_program(device, heads, feature, splits):
    """Programs of two KV heads (both groups' query rows in one tile, each head's product over a copy of the query
    with the other head's rows zero) give what programs of one give: the new keys and values written, rotated
    and head-normalised, windows, soft caps, sinks, splits merged by the kernel or by the last split."""
    import dataclasses

    from engine_plugin_sdk import HeadNorm

    kw = {"sliding_window": 12, "soft_cap": 2.0} if feature == "window_cap" else {}
    problem, cache = filled_problem(device, torch.float16, DECODE_LENS, heads=heads, kv_heads=4, seed=heads + splits,
                                    sinks=feature == "sinks", **kw)  # fmt: skip
    md = problem.metadata
    gen = torch.Generator().manual_seed(heads * splits)
    extra = {"window": md.sliding_window, "soft_cap": md.logits_soft_cap, "sinks": md.sinks}
    # the step's own keys and values, through the kernel's write (already in the cache: rewritten the same unless
    # rotated)
    extra["new_kv"] = (problem.key, problem.value, md.slot_mapping)
    if feature == "rotary_head_norm":
        weights = (1.0 + 0.5 * torch.randn(2, 64, generator=gen)).to(torch.float16).to(device)
        extra["rotary"] = ((md.seq_lens - 1).long(), make_cos_sin_cache(128, 64).to(device))
        extra["head_norm"] = HeadNorm(weights[0], weights[1], 1e-6)
    base = tuning()
    paired = dataclasses.replace(base, decode_paired_fp8=(16, 4, 1), decode_paired_any_cache=True, num_compute_units=1)
    assert paired.decode_kv_heads(False, 4, 4, heads // 4) == 2 and base.decode_kv_heads(False, 4, 4, heads // 4) == 1
    outs, caches = [], []
    for t in (base, paired):
        out, kv = torch.full_like(problem.query, float("nan")), cache.clone()
        arrivals = torch.zeros(64, dtype=torch.int32, device=device) if feature == "merge_last" else None
        launchers.paged_decode(out, problem.query, kv, md.block_tables, md.seq_lens, md.scale, splits, t,
                               arrivals=arrivals, **extra)  # fmt: skip
        assert arrivals is None or not arrivals.any()
        outs.append(out)
        caches.append(kv)
    assert torch.equal(caches[0], caches[1]), "both write the same new keys and values"
    assert torch.equal(caches[1], cache) != (feature == "rotary_head_norm")
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-3, atol=2e-3)
    if feature != "rotary_head_norm":
        check(outs[1], problem, f"two KV heads a program, {feature}, splits={splits}")

@triton.jit
def _no_wait():
    # the interpreter runs a jit function only where its module holds triton.language
    tl.static_assert(True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real PDL path (test_pdl.py)")
@pytest.mark.parametrize("paired", [False, True])
def test_decode_early_kv_path_matches_the_plain_one(device, monkeypatch, paired):
    """The path only CUDA graphs with PDL compile (the first tile, the rotation and the head norms' scales read
    before the wait, the tile then folded in ahead of the loop; the merge's context lengths before its own wait),
    run in the interpreter with the waits stubbed: the same outputs and cache as the plain path, bit for bit, with
    the step's KV write, rotary and head norms (one KV head a program over two splits merged by the merge kernel,
    two over one)."""
    import dataclasses

    from engine_plugin_sdk import HeadNorm
    from engine_plugin_sdk.gpu.triton_kernels import decode_attention_kernels, decode_merge_kernels, pdl

    for module in (decode_attention_kernels, decode_merge_kernels, pdl):
        monkeypatch.setattr(module, "gdc_wait", _no_wait)
        monkeypatch.setattr(module, "gdc_launch_dependents", _no_wait)
    options = pdl.launch_options
    monkeypatch.setattr(pdl, "launch_options", lambda: {k: v for k, v in options().items() if k != "launch_pdl"})
    problem, cache = filled_problem(device, torch.float16, DECODE_LENS, heads=16, kv_heads=4, seed=11 + paired)
    md = problem.metadata
    gen = torch.Generator().manual_seed(12)
    weights = (1.0 + 0.5 * torch.randn(2, 64, generator=gen)).to(torch.float16).to(device)
    extra = {"new_kv": (problem.key, problem.value, md.slot_mapping), "head_norm": HeadNorm(weights[0], weights[1], 1e-6),
             "rotary": ((md.seq_lens - 1).long(), make_cos_sin_cache(128, 64).to(device))}  # fmt: skip
    # enough multiprocessors that 4 sequences' programs count as a small grid (the early read's condition)
    t, splits = dataclasses.replace(tuning(), num_compute_units=132), 2
    if paired:
        # two KV heads a program need few enough multiprocessors that half the programs fill them twice; one split
        # keeps that grid small
        t, splits = dataclasses.replace(t, decode_paired_fp8=(16, 4, 1), decode_paired_any_cache=True, num_compute_units=4), 1
        assert t.decode_kv_heads(False, 4, 4, 4) == 2
    programs = 4 // (1 + paired) * 4 * splits
    assert programs <= launchers.EARLY_KV_WAVES * t.num_compute_units, "the early read must be in effect"
    results = []
    for active in (False, True):
        monkeypatch.setattr(pdl, "_active", active)
        out, kv = torch.full_like(problem.query, float("nan")), cache.clone()
        launchers.paged_decode(out, problem.query, kv, md.block_tables, md.seq_lens, md.scale, splits, t, **extra)
        results.append((out, kv))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not results[1][0].isnan().any()


@pytest.mark.parametrize("active", [False, True])
def test_decode_asking_l2_for_the_next_weight_changes_nothing(device, monkeypatch, active):
    """``l2_ahead`` (an experiment: the decode kernel's programs ask L2 for the next GEMV's weight once past their
    wait, the idle splits too): the same outputs and cache bit for bit, on the plain path and on the early path
    (whose idle splits then wait before they ask; the waits stubbed in the interpreter), and the programs' shares
    cover every line of a weight whose lines do not split evenly among them."""
    from engine_plugin_sdk.gpu.triton_kernels import decode_attention_kernels, decode_merge_kernels, pdl

    for module in (decode_attention_kernels, decode_merge_kernels, pdl):
        monkeypatch.setattr(module, "gdc_wait", _no_wait)
        monkeypatch.setattr(module, "gdc_launch_dependents", _no_wait)
    options = pdl.launch_options
    monkeypatch.setattr(pdl, "launch_options", lambda: {k: v for k, v in options().items() if k != "launch_pdl"})
    monkeypatch.setattr(pdl, "_active", active)
    problem, cache = filled_problem(device, torch.float16, DECODE_LENS, heads=8, kv_heads=2, seed=31 + active)
    md = problem.metadata
    weight = torch.randn(37, 100, generator=torch.Generator().manual_seed(5)).to(torch.float16).to(device)
    share = l2_share_args(weight, 2 * 4 * 8, False)
    assert share["l2_lines"] == 58 and share["L2_LINES"] * 2 * 4 * 8 >= 58
    t = dataclasses.replace(tuning(), num_compute_units=132)
    new_kv = (problem.key, problem.value, md.slot_mapping)
    results = []
    for ahead in (None, weight):
        out, kv = torch.full_like(problem.query, float("nan")), cache.clone()
        launchers.paged_decode(out, problem.query, kv, md.block_tables, md.seq_lens, md.scale, 8, t, new_kv=new_kv,
                               l2_ahead=ahead)  # fmt: skip
        results.append((out, kv))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not results[1][0].isnan().any()


def test_decode_padding_rows_give_zeros_and_write_nothing(device):
    """Graph padding rows: slot -1 (no cache write) and context length 0 (zeros out, no NaN)."""
    problem, cache = filled_problem(device, torch.float32, DECODE_LENS, seed=5)
    md = problem.metadata
    before = cache.clone()
    pad = 3
    query = torch.cat([problem.query, torch.randn(pad, *problem.query.shape[1:]).to(device)])
    key = torch.randn(pad, *problem.key.shape[1:]).to(device)
    launchers.write_kv(key, key, cache, torch.full((pad,), -1, dtype=torch.int64, device=device))
    assert torch.equal(cache, before), "a slot of -1 must not write"
    seq_lens = torch.cat([md.seq_lens, torch.zeros(pad, dtype=torch.int32, device=device)])
    tables = torch.cat([md.block_tables, torch.zeros(pad, md.block_tables.shape[1], dtype=torch.int32, device=device)])
    out = torch.full_like(query, float("nan"))
    launchers.paged_decode(out, query, cache, tables, seq_lens, md.scale, 2, tuning())
    check(out[: len(DECODE_LENS[0])], problem, "decode with padding rows")
    assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize(
    ("head_dim", "block_size", "feature", "dtype"),
    [(64, 16, "plain", torch.float16), (128, 32, "window", torch.float32), (64, 32, "soft_cap", torch.float32),
     (128, 16, "plain", torch.float32)],
)
def test_decode_writes_the_new_kv_itself(device, splits, head_dim, block_size, feature, dtype):
    """Pure decode with ``new_kv``: the kernel stores each new key/value at its slot and attends to it;
    graph padding rows (slot -1, length 0) write nothing and give zeros. Contexts of 1 token included."""
    kw = {"sliding_window": 12} if feature == "window" else {"soft_cap": 2.0} if feature == "soft_cap" else {}
    seed = 31 * splits + head_dim + block_size
    problem = make_attention_problem(
        4, DECODE_LENS[0], DECODE_LENS[1], 8, 2, head_dim, block_size, 64, dtype=dtype, device=device, seed=seed, **kw
    )
    gen = torch.Generator().manual_seed(seed + 1)
    cache = torch.randn((2, 64, block_size, 2, head_dim), generator=gen).to(dtype).to(device)
    launchers.write_kv(problem.prefix_key, problem.prefix_value, cache, problem.prefix_slot_mapping)
    md, pad = problem.metadata, 2
    expected = cache.clone()
    launchers.write_kv(problem.key, problem.value, expected, md.slot_mapping)

    def rows(t):  # the new rows plus padding rows, as a view with a row stride wider than the row
        extra = torch.randn(pad, *t.shape[1:], generator=gen).to(dtype).to(device)
        wide = torch.cat([torch.cat([t, extra]), torch.randn(len(t) + pad, *t.shape[1:], generator=gen).to(device)], -1)
        return wide[..., : t.shape[-1]]

    query, key, value = rows(problem.query), rows(problem.key), rows(problem.value)
    slots = torch.cat([md.slot_mapping, torch.full((pad,), -1, dtype=md.slot_mapping.dtype, device=device)])
    seq_lens = torch.cat([md.seq_lens, torch.zeros(pad, dtype=torch.int32, device=device)])
    tables = torch.cat([md.block_tables, torch.zeros(pad, md.block_tables.shape[1], dtype=torch.int32, device=device)])
    out = torch.full(query.shape, float("nan"), dtype=dtype, device=device)
    launchers.paged_decode(
        out, query.contiguous(), cache, tables, seq_lens, md.scale, splits, tuning(),
        window=md.sliding_window, soft_cap=md.logits_soft_cap, new_kv=(key, value, slots),
    )  # fmt: skip
    check(out[:-pad], problem, f"decode writing its kv, splits={splits} head {head_dim} block {block_size} {feature}")
    assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))
    assert torch.equal(cache, expected), "the new keys/values belong at their slots, and nothing else may change"


def test_decode_split_choice():
    t = KernelTuning(num_compute_units=132, max_decode_splits=32, min_keys_per_split=256)
    assert t.decode_splits(1, 8, None) == 32  # batch 1: fill the GPU
    assert t.decode_splits(1, 8, 1000) == 2  # short context: no split under 256 keys
    assert t.decode_splits(256, 8, 8192) == 1  # big batch fills the GPU by itself
    assert all(t.decode_splits(b, 8, None) & (t.decode_splits(b, 8, None) - 1) == 0 for b in range(1, 300))


def test_decode_pairs_kv_heads_over_an_fp8_cache_for_large_batches_only():
    t = KernelTuning(num_compute_units=132, decode_paired_fp8=(64, 4, 2))
    assert t.decode_kv_heads(True, 1008, 8, 4) == 2 and t.decode_tiles(True, 128, 2)["BLOCK_N"] == 64
    assert t.decode_kv_heads(False, 1008, 8, 4) == 1  # a bf16 cache is read at its bandwidth already
    assert t.decode_kv_heads(True, 32, 8, 4) == 1  # 128 programs of two heads would not fill the GPU twice
    assert t.decode_kv_heads(True, 1008, 8, 16) == 1  # two groups of 16 query heads overflow a 16-row tile
    assert t.decode_kv_heads(True, 1008, 1, 8) == 1  # one KV head: nothing to pair
    assert t.decode_kv_heads(True, 1008, 8, 4, 256) == 1  # heads of 256 (Gemma) keep their own tiles
    assert KernelTuning().decode_kv_heads(True, 1008, 8, 4) == 1  # no paired tiles: never


def test_decode_tiles_by_cache_and_head_size():
    """Heads over 128 take their own decode tiles where the table gives them; an FP8 cache its own."""
    t = KernelTuning(decode_block_n=64, decode_fp8=(128, 4, 2), decode_large_head=(32, 4, 2))
    assert t.decode_tiles(False, 128)["BLOCK_N"] == 64
    assert t.decode_tiles(False, 256) == {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    assert t.decode_tiles(True, 256)["BLOCK_N"] == 128
    assert KernelTuning(decode_block_n=64).decode_tiles(False, 256)["BLOCK_N"] == 64

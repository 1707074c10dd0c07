"""The shared Triton kernels against float64 references, on small shapes (interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels import INTERPRETER_TUNING, KernelTuning, gemv_launchers, launchers
from engine_plugin_sdk.gpu.triton_kernels.post_norm import post_norm_add_rms_norm
from engine_plugin_sdk.problems import make_attention_problem
from engine_plugin_sdk.reference_ops import (
    make_cos_sin_cache,
    ref_add_layer_norm,
    ref_fused_add_rms_norm,
    ref_gated_linear,
    ref_gelu_tanh_and_mul,
    ref_layer_norm,
    ref_post_norm_add_rms_norm,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
)
from engine_plugin_sdk.tolerances import compare, get_tolerance

DECODE_LENS = ([1, 1, 1, 1], [1, 15, 40, 97])
MIXED_LENS = ([5, 1, 16, 1, 9], [37, 50, 16, 3, 73])


def tuning() -> KernelTuning:
    return INTERPRETER_TUNING if not torch.cuda.is_available() else KernelTuning()


def filled_problem(device, dtype, lens, block_size=16, head_dim=64, heads=8, kv_heads=2, seed=0, **kw):
    problem = make_attention_problem(
        len(lens[0]), lens[0], lens[1], heads, kv_heads, head_dim, block_size, 64,
        dtype=dtype, device=device, seed=seed, **kw,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 100)
    cache = torch.randn((2, 64, block_size, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    launchers.write_kv(problem.prefix_key, problem.prefix_value, cache, problem.prefix_slot_mapping)
    launchers.write_kv(problem.key, problem.value, cache, problem.metadata.slot_mapping)
    return problem, cache


def check(out, problem, what):
    problem_text = compare(out, problem.reference_output(), problem.tolerance(), what)
    assert not problem_text, problem_text


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


@pytest.mark.parametrize("splits", [8, 16])
@pytest.mark.parametrize("window", [None, 12])
def test_decode_merges_only_the_splits_that_hold_keys(device, splits, window, monkeypatch):
    """A graph's split count is fixed for any context: splits past a short context's end write no partials
    and the merge must not read them. The partial buffers start as NaN here, so a merge that read an
    unwritten split would give NaN."""
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
            out, problem.query, cache, md.block_tables, md.seq_lens, md.scale, splits, tuning(), window=window
        )  # fmt: skip
    check(out, problem, f"decode splits={splits} window={window}, most splits idle")


@pytest.mark.parametrize("splits", [2, 4])
def test_decode_last_split_merges_when_given_arrival_counts(device, splits):
    """With ``arrivals`` the split programs count themselves and the last of each KV head's merges its
    heads (no merge kernel): the same result as the merge kernel's, and every count back at zero."""
    problem, cache = filled_problem(device, torch.float16, DECODE_LENS, seed=40 + splits, sliding_window=12)
    md = problem.metadata
    outs = []
    arrivals = torch.zeros(64, dtype=torch.int32, device=device)
    for given in (None, arrivals, arrivals):
        out = torch.full_like(problem.query, float("nan"))
        launchers.paged_decode(
            out, problem.query, cache, md.block_tables, md.seq_lens, md.scale, splits, tuning(),
            window=md.sliding_window, arrivals=given,
        )  # fmt: skip
        outs.append(out)
        assert not arrivals.any()
    check(outs[1], problem, f"decode splits={splits} merged by the last split")
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


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
    """The path only CUDA graphs with PDL compile (the first tile read before the wait, then folded in ahead of the
    loop), run in the interpreter with the waits stubbed: the same outputs and cache as the plain path, bit for bit,
    with the step's KV write, rotary and head norms (one KV head a program over two splits merged by the kernel,
    two over one)."""
    import dataclasses

    from engine_plugin_sdk import HeadNorm
    from engine_plugin_sdk.gpu.triton_kernels import decode_attention_kernels, pdl

    for module in (decode_attention_kernels, pdl):
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


@pytest.mark.parametrize("head_dim,block_size,kv_heads", [(80, 8, 1), (128, 32, 4), (256, 16, 2), (96, 64, 8)])
def test_prefill_and_decode_geometries(device, head_dim, block_size, kv_heads):
    for lens, seed in ((MIXED_LENS, 1), (DECODE_LENS, 2)):
        problem, cache = filled_problem(
            device, torch.float32, lens, block_size=block_size, head_dim=head_dim, kv_heads=kv_heads, seed=seed
        )
        md = problem.metadata
        out = torch.full_like(problem.query, float("nan"))
        launchers.paged_prefill(
            out, problem.query, cache, md.block_tables, md.seq_lens, md.query_start_loc, md.max_query_len,
            md.scale, tuning(),
        )  # fmt: skip
        check(out, problem, f"prefill head {head_dim} block {block_size}")


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


def test_write_kv_from_strided_views(device):
    """Keys and values arrive as column slices of the fused qkv projection."""
    tokens, kv_heads, head_dim = 7, 2, 64
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim).to(device)
    _, k, v = qkv.split([4 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.reshape(tokens, kv_heads, head_dim), v.reshape(tokens, kv_heads, head_dim)
    cache = torch.randn(2, 4, 16, kv_heads, head_dim).to(device)
    slots = torch.tensor([3, 17, 0, 63, 40, 41, 5], device=device)
    expected = cache.clone().view(2, 64, kv_heads, head_dim)
    expected[0, slots], expected[1, slots] = k, v
    launchers.write_kv(k, v, cache, slots)
    assert torch.equal(cache.view(2, 64, kv_heads, head_dim), expected)


def test_fused_ops(device, kernel_dtypes):
    gen = torch.Generator().manual_seed(7)
    for dtype in kernel_dtypes:
        tol = get_tolerance(dtype)

        def rand(*shape, dtype=dtype):
            return torch.randn(*shape, generator=gen).to(dtype).to(device)

        x, residual, w = rand(5, 200), rand(5, 200), rand(200)
        assert not compare(launchers.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), tol, "rms_norm")
        out, summed = launchers.fused_add_rms_norm(x, residual, w, 1e-6)
        ref_out, ref_sum = ref_fused_add_rms_norm(x, residual, w, 1e-6)
        assert not compare(out, ref_out, tol, "fused_add_rms_norm")
        assert torch.equal(summed, x + residual)
        # Gemma's post-norm + add + pre-norm: a branch much larger than the residual, so that adding it
        # un-normalised (or normalising after the add only) is far off
        post_w, branch = rand(200), rand(5, 200) * 30
        out, summed = post_norm_add_rms_norm(branch, residual, post_w, w, 1e-6)
        ref_out, ref_sum = ref_post_norm_add_rms_norm(branch, residual, post_w, w, 1e-6)
        assert not compare(out, ref_out, tol, "post_norm_add_rms_norm")
        assert not compare(summed, ref_sum, tol, "post_norm_add_rms_norm sum")
        assert out.dtype == summed.dtype == dtype
        # 200 is not a power of two: the padding lanes must stay out of the mean and the variance
        shifted, b = x + 2.0, rand(200)
        assert not compare(launchers.layer_norm(shifted, w, b, 1e-5), ref_layer_norm(shifted, w, b, 1e-5), tol, "layer_norm")
        assert not compare(launchers.layer_norm(shifted, w, None, 1e-5), ref_layer_norm(shifted, w, None, 1e-5), tol, "layer_norm")
        # BERT's residual connection inside the norm: the sum rounds to the dtype, then the norm
        fused = launchers.add_layer_norm(shifted, residual * 3, w, b, 1e-5)
        assert not compare(fused, ref_add_layer_norm(shifted, residual * 3, w, b, 1e-5), tol, "add_layer_norm")
        assert torch.equal(fused, launchers.layer_norm(shifted + residual * 3, w, b, 1e-5))
        gate_up = rand(3, 2, 2 * 96)
        assert not compare(launchers.silu_and_mul(gate_up), ref_silu_and_mul(gate_up), tol, "silu_and_mul")
        gate_up = gate_up * 4  # reach both tails of the tanh
        assert not compare(launchers.gelu_tanh_and_mul(gate_up), ref_gelu_tanh_and_mul(gate_up), tol, "gelu_tanh_and_mul")
        # rotary on strided views of a fused qkv, in place
        qkv = rand(6, (6 + 2 * 2) * 64)
        q = qkv[:, : 6 * 64].view(6, 6, 64)
        k = qkv[:, 6 * 64 : 8 * 64].view(6, 2, 64)
        positions = torch.randint(0, 300, (6,), generator=gen).to(device)
        cache = make_cos_sin_cache(300, 64).to(device)
        ref_q, ref_k = ref_rotary_embedding(positions, q.clone(), k.clone(), cache)
        got_q, got_k = launchers.rotary_embedding(positions, q, k, cache)
        assert not compare(got_q, ref_q, tol, "rotary q") and not compare(got_k, ref_k, tol, "rotary k")


@pytest.mark.parametrize("split", [False, True])  # the one-pass kernel, and split chunks plus a merge
@pytest.mark.parametrize("vocab,width", [(1000, 1000), (5000, 5120), (9000, 9000)])
def test_greedy_pick(device, monkeypatch, vocab, width, split):
    monkeypatch.setattr(launchers, "GREEDY_SPLIT", split)
    gen = torch.Generator().manual_seed(vocab)
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    for dtype in dtypes:
        logits = (torch.randn(6, width, generator=gen) * 5).to(dtype)
        logits[:, vocab:] = 1e4  # padding columns: never picked, never in the sum
        logits[3, 17] = logits[3, 4000 % vocab] = 60.0  # a tie inside a chunk: the first position wins
        logits[2, 100] = logits[2, vocab - 3] = 60.0  # a tie across chunks (for the wider vocabularies)
        logits[4, : vocab // 2] = float("-inf")  # whole chunks masked out (a grammar's bitmask)
        ids, logprobs = launchers.greedy_pick(logits.to(device), vocab)
        raw = torch.log_softmax(logits[:, :vocab].double(), dim=-1)
        assert ids.tolist() == raw.argmax(dim=-1).tolist() and ids[3] == min(17, 4000 % vocab) and ids[2] == 100
        want = raw.gather(1, ids.cpu()[:, None]).squeeze(1)
        assert logprobs.dtype == torch.float32
        torch.testing.assert_close(logprobs.cpu().double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not \\[rows"):
        launchers.greedy_pick(torch.zeros(2, 10, device=device), 11)


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


@pytest.mark.parametrize(
    ("out_features", "in_features", "tile", "dtype"),
    [(40, 64, (16, 32), torch.float16), (37, 100, (8, 32), torch.float32), (24, 2048, (4, 1024), torch.float16)],
)
def test_gemv_matches_float64(device, out_features, in_features, tile, dtype):
    gen = torch.Generator().manual_seed(out_features * in_features)
    x = torch.randn(1, in_features, generator=gen).to(dtype).to(device)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype).to(device)
    bias = torch.randn(out_features, generator=gen).to(dtype).to(device)
    ref = x.double() @ weight.double().T + bias.double()
    out = gemv_launchers.gemv(x, weight, bias, block_n=tile[0], block_k=tile[1])
    assert out.shape == (1, out_features) and out.dtype == dtype
    # fp32 accumulation; the only rounding beyond it is the store in the output dtype
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    no_bias = gemv_launchers.gemv(x[0], weight, block_n=tile[0], block_k=tile[1])
    torch.testing.assert_close(no_bias.double(), ref[0] - bias.double(), rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(
    ("d", "in_features", "tile", "dtype"),
    [(40, 64, (16, 32), torch.float16), (37, 100, (8, 32), torch.float32), (24, 2048, (4, 1024), torch.float16)],
)
def test_gated_gemv_matches_float64(device, activation, d, in_features, tile, dtype):
    """The fused gate/up GEMV with its activation epilogue, ragged row blocks and K tails included."""
    gen = torch.Generator().manual_seed(d * in_features + len(activation))
    x = torch.randn(1, in_features, generator=gen).to(dtype).to(device)
    weight = (torch.randn(2 * d, in_features, generator=gen) * in_features**-0.5).to(dtype).to(device)
    ref = ref_gated_linear(x, weight, activation)
    out = gemv_launchers.gated_gemv(x, weight, activation, block_n=tile[0], block_k=tile[1])
    assert out.shape == (1, d) and out.dtype == dtype
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    with pytest.raises(ValueError, match="odd"):
        gemv_launchers.gated_gemv(x, weight[1:], activation)
    with pytest.raises(ValueError, match="unknown gated activation"):
        gemv_launchers.gated_gemv(x, weight, "relu")


def test_gemv_refuses_more_than_one_row(device):
    with pytest.raises(ValueError, match="one row"):
        gemv_launchers.gemv(torch.randn(2, 8).to(device), torch.randn(4, 8).to(device))


def test_batch1_products_take_the_gemv_on_a_gpu(device):
    """Single-row bf16/fp16 products run the Triton GEMV on a GPU (wide ones only inside a graph capture);
    more rows, or the CPU, go to torch. The backend's result matches float64 either way."""
    from engine_plugin_nvidia import gemm

    gen = torch.Generator().manual_seed(404)
    x = torch.randn(1, 96, generator=gen).to(torch.float16).to(device)
    for out_features in (40, 300):  # narrow (out <= in) and wide
        weight = torch.randn(out_features, 96, generator=gen).to(torch.float16).to(device)
        # eagerly, wide products stay on cuBLAS (cheaper to launch); inside a graph capture they take the GEMV
        want = gemm.GEMV_TILE if out_features <= 96 else None
        assert gemm._gemv_tile(x, weight) is (want if device.type == "cuda" else None)
        if device.type == "cuda" and out_features > 96:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = gemm._gemv_tile(x, weight)
            assert captured is gemm.GEMV_WIDE_TILE
        assert gemm._gemv_tile(torch.cat([x, x]), weight) is None
        out = gemm.CudaGemmBackend(device).linear(x, weight)
        ref = x.double() @ weight.double().T
        torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
        # the LM head: float32 logits (on a GPU straight from the GEMV's accumulator, eagerly too)
        logits = gemm.CudaGemmBackend(device).logits(x, weight)
        assert logits.dtype == torch.float32 and logits.shape == (1, out_features)
        tol = 1e-5 if device.type == "cuda" else 2e-3  # the CPU's fallback rounds through float16
        torch.testing.assert_close(logits.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("num_decodes", [2, 6])
def test_mixed_batch_leading_decode_rows_take_the_decode_kernel(device, monkeypatch, num_decodes):
    """Decode rows ahead of prompt chunks go to the decode kernel once they fill the device without
    splitting their contexts; fewer stay with the prefill kernel, so a split count never becomes a new
    kernel variant to compile mid-serving."""
    from engine_plugin_nvidia.attention import TritonAttentionBackend

    lens = ([1] * num_decodes + [7, 1, 12], [40, 9, 77, 33, 5, 61][:num_decodes] + [7, 30, 60])
    problem = make_attention_problem(
        len(lens[0]), lens[0], lens[1], 8, 2, 64, 16, 64, dtype=torch.float32, device=device, seed=13,
    )  # fmt: skip
    decoded: list[int] = []
    real = launchers.paged_decode

    def counting(out, query, *args, **kwargs):
        decoded.append(query.shape[0])
        return real(out, query, *args, **kwargs)

    monkeypatch.setattr(launchers, "paged_decode", counting)
    # small tiles and 4 compute units on every machine: 2 rows x 2 KV heads are 4 programs, which the
    # decode kernel would split in two to fill the 4 units twice over; 6 rows (12 programs) need no split
    assert INTERPRETER_TUNING.decode_splits(2, 2, None) == 2 and INTERPRETER_TUNING.decode_splits(6, 2, None) == 1
    out = problem.run(TritonAttentionBackend(INTERPRETER_TUNING))
    assert decoded == ([] if num_decodes == 2 else [6])
    check(out, problem, f"{num_decodes} leading decode rows")


def test_attention_backend_keeps_arrival_counts_only_when_its_tuning_merges_last(device):
    import dataclasses

    from engine_plugin_sdk.gpu.attention import TritonPagedAttentionBackend

    assert TritonPagedAttentionBackend(tuning()).decode_arrivals(8, device) is None
    backend = TritonPagedAttentionBackend(dataclasses.replace(tuning(), decode_merge_last=True))
    first = backend.decode_arrivals(8, device)
    assert first is not None and first.dtype == torch.int32 and not first.any()
    assert backend.decode_arrivals(16, device) is first, "kept across steps, not made per call"
    assert backend.decode_arrivals(5000, device).numel() >= 5000

"""The SDK's references checked against independent implementations (torch SDPA, HF rotary, plain formulas)."""

from __future__ import annotations

import pytest
import torch

from engine.interfaces import ops as core_ops
from engine_plugin_sdk.problems import make_attention_problem
from engine_plugin_sdk.quant import UnknownSchemeError, make_quantized_weight
from engine_plugin_sdk.reference_backends import (
    ReferenceAttentionBackend,
    ReferenceBlockCache,
    ReferenceGemmBackend,
)
from engine_plugin_sdk.reference_ops import (
    make_cos_sin_cache,
    ref_attention,
    ref_fused_add_rms_norm,
    ref_linear,
    ref_paged_attention,
    ref_quantized_linear,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
    ref_write_kv,
)
from engine_plugin_sdk.tolerances import TOLERANCES, compare, get_tolerance

F64 = torch.float64


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int) -> torch.Tensor:
    """torch's SDPA for one sequence: q ``[q_len, H, D]`` at the end of k/v ``[ctx, H, D]``."""
    q_len, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx).unsqueeze(0) <= (torch.arange(q_len).unsqueeze(1) + causal_offset)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


def test_ref_attention_matches_sdpa_for_a_mixed_gqa_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    query_lens, ctx_lens, heads, kv_heads, dim = [1, 6, 9], [20, 6, 30], 6, 2, 32
    q = torch.randn(sum(query_lens), heads, dim, generator=gen, dtype=F64)
    ks = [torch.randn(c, kv_heads, dim, generator=gen, dtype=F64) for c in ctx_lens]
    vs = [torch.randn(c, kv_heads, dim, generator=gen, dtype=F64) for c in ctx_lens]
    out = ref_attention(q, ks, vs, query_lens, scale=dim**-0.5)
    start = 0
    for q_len, ctx, k, v in zip(query_lens, ctx_lens, ks, vs, strict=True):
        expect = sdpa_reference(
            q[start : start + q_len], k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), ctx - q_len
        )
        torch.testing.assert_close(out[start : start + q_len], expect, rtol=1e-10, atol=1e-10)
        start += q_len


def test_sliding_window_and_soft_cap_change_the_result_as_specified() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 16, generator=gen, dtype=F64)
    k = torch.randn(10, 2, 16, generator=gen, dtype=F64)
    v = torch.randn(10, 2, 16, generator=gen, dtype=F64)
    windowed = ref_attention(q, [k], [v], [1], 0.25, sliding_window=3)
    # a window of 3 at position 9 sees positions 7, 8, 9 only
    torch.testing.assert_close(windowed, ref_attention(q, [k[7:]], [v[7:]], [1], 0.25))
    capped = ref_attention(q, [k], [v], [1], 0.25, logits_soft_cap=0.5)
    scores = 0.5 * torch.tanh(torch.einsum("hd,khd->hk", q[0], k) * 0.25 / 0.5)
    expect = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), v).unsqueeze(0)
    torch.testing.assert_close(capped, expect)


def test_problem_block_tables_and_slots_are_consistent() -> None:
    p = make_attention_problem(4, [1, 5, 16, 2], [33, 5, 40, 2], 8, 2, 32, 8, 64, seed=3)
    used = [b for t in p.block_tables for b in t]
    assert len(used) == len(set(used)) == sum(-(-c // 8) for c in p.seq_lens)
    assert used != sorted(used), "blocks should be scattered, not in order"
    assert p.metadata.query_start_loc.tolist() == [0, 1, 6, 22, 24]
    assert p.metadata.block_tables.shape[1] == max(len(t) for t in p.block_tables) + 1
    assert p.prefix_slot_mapping.numel() == sum(c - q for c, q in zip(p.seq_lens, p.query_lens, strict=True))
    assert len(set(p.metadata.slot_mapping.tolist()) | set(p.prefix_slot_mapping.tolist())) == sum(p.seq_lens)


def test_paged_reference_reads_back_what_write_kv_stored() -> None:
    p = make_attention_problem(3, [2, 1, 7], [20, 9, 7], 4, 1, 16, 4, 32, dtype=F64, seed=4)
    keys = torch.randn(32, 4, 1, 16, dtype=F64)
    values = torch.randn(32, 4, 1, 16, dtype=F64)
    all_keys = torch.cat([k for k in p.key_history])
    all_values = torch.cat([v for v in p.value_history])
    slots = []
    for table, ctx in zip(p.block_tables, p.seq_lens, strict=True):
        slots += [table[i // 4] * 4 + i % 4 for i in range(ctx)]
    keys, values = ref_write_kv(all_keys, all_values, keys, values, torch.tensor(slots))
    out = ref_paged_attention(
        p.query, keys, values, p.block_tables, p.seq_lens, p.query_lens, p.metadata.scale
    )
    torch.testing.assert_close(out, p.reference_output())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_backend_solves_problems(dtype: torch.dtype) -> None:
    p = make_attention_problem(
        3, [1, 4, 12], [50, 4, 30], 8, 2, 64, 16, 128, dtype=dtype, seed=5, sliding_window=9, soft_cap=2.0
    )
    assert compare(p.run(ReferenceAttentionBackend()), p.reference_output(), p.tolerance(), "reference") == ""


def test_non_causal_problem_is_whole_prompts_against_bidirectional_sdpa() -> None:
    lens = [1, 7, 33]
    p = make_attention_problem(3, lens, lens, 8, 2, 64, 16, 128, seed=7, causal=False)
    assert not p.metadata.causal and p.prefix_slot_mapping.numel() == 0
    expected, start = [], 0
    for n, k, v in zip(lens, p.key_history, p.value_history, strict=True):
        q = p.query[start : start + n].to(F64).transpose(0, 1)
        kv = [t.to(F64).repeat_interleave(4, 1).transpose(0, 1) for t in (k, v)]
        expected.append(torch.nn.functional.scaled_dot_product_attention(q, *kv).transpose(0, 1))
        start += n
    torch.testing.assert_close(p.reference_output(), torch.cat(expected), rtol=1e-10, atol=1e-10)
    assert compare(p.run(ReferenceAttentionBackend()), p.reference_output(), p.tolerance(), "reference") == ""
    # the same inputs under the causal mask give another answer: the row would catch a backend ignoring it
    causal = make_attention_problem(3, lens, lens, 8, 2, 64, 16, 128, seed=7)
    torch.testing.assert_close(causal.query, p.query)
    assert compare(causal.reference_output(), p.reference_output(), p.tolerance(), "causal")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"query_lens": [3], "context_lens": [5], "causal": False}, "no cached prefix"),
        ({"query_lens": [3], "context_lens": [2]}, "query_len <= context_len"),
        ({"query_lens": [1, 1], "context_lens": [2]}, "entries each"),
        ({"query_lens": [1], "context_lens": [1000]}, "blocks but the pool has"),
        ({"query_lens": [1], "context_lens": [4], "num_heads": 3}, "not a multiple"),
    ],
)
def test_problem_rejects_bad_input(kwargs: dict, message: str) -> None:
    args = {"num_seqs": len(kwargs["query_lens"]), "num_heads": 4, "num_kv_heads": 2, "head_dim": 8}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        make_attention_problem(block_size=4, num_blocks=16, **args)


def test_fused_op_references_match_the_core_ops_and_hf_rotary() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(6)
    x, res, w = (torch.randn(5, 64, generator=gen) for _ in range(3))
    w = w[0]
    torch.testing.assert_close(ref_rms_norm(x, w, 1e-6).float(), core_ops.rms_norm(x, w, 1e-6))
    normed, summed = ref_fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(summed, (x + res).double())
    torch.testing.assert_close(normed.float(), core_ops.rms_norm(x + res, w, 1e-6))
    gate_up = torch.randn(5, 128, generator=gen)
    torch.testing.assert_close(ref_silu_and_mul(gate_up).float(), core_ops.silu_and_mul(gate_up))

    positions = torch.tensor([0, 3, 17, 100])
    q, k = torch.randn(4, 4, 32, generator=gen), torch.randn(4, 2, 32, generator=gen)
    cache = make_cos_sin_cache(128, 32)
    rq, rk = ref_rotary_embedding(positions, q, k, cache)
    cos = torch.cat([cache[positions, :16]] * 2, dim=-1)
    sin = torch.cat([cache[positions, 16:]] * 2, dim=-1)
    hq, hk = apply_rotary_pos_emb(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0)
    )
    torch.testing.assert_close(rq.float(), hq[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rk.float(), hk[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["int8", "fp8_e4m3", "gguf_q4_0", "gguf_q8_0"])
def test_quantized_weights_dequantize_close_to_random_dense(scheme: str) -> None:
    weight = make_quantized_weight(scheme, 16, 256, seed=7)
    dense = weight.dequantize()
    assert dense.shape == (16, 256) and dense.dtype == torch.float32
    x = torch.randn(3, 256)
    gemm = ReferenceGemmBackend()
    out = gemm.linear(x, gemm.prepare_weight(weight, torch.float32))
    assert compare(out, ref_quantized_linear(x, weight), get_tolerance("float32"), scheme) == ""
    if scheme == "int8":
        torch.testing.assert_close(dense, weight.data.float() * weight.extra["scale"][:, None])


def test_unknown_schemes_and_dtypes_fail_clearly() -> None:
    with pytest.raises(UnknownSchemeError, match="no test-weight generator"):
        make_quantized_weight("awq_int4", 4, 256)
    with pytest.raises(UnknownSchemeError, match="unknown GGUF quantization type"):
        make_quantized_weight("gguf_q9_9", 4, 256)
    with pytest.raises(KeyError, match="no tolerance for dtype"):
        get_tolerance("int8")
    assert get_tolerance("bfloat16", "float8_e4m3fn").atol >= TOLERANCES["bfloat16"].atol


def test_compare_describes_the_worst_element() -> None:
    expected = torch.zeros(2, 3, dtype=F64)
    actual = expected.clone()
    actual[1, 2] = 0.5
    message = compare(actual, expected, get_tolerance("float32"), "thing")
    assert message.startswith("thing: 1/6 elements") and "(1, 2)" in message
    assert "shape" in compare(actual[0], expected, get_tolerance("float32"), "thing")
    assert compare(actual, actual.clone(), get_tolerance("float32"), "thing") == ""
    assert ref_linear(torch.ones(1, 2), torch.ones(3, 2), torch.ones(3)).tolist() == [[3.0, 3.0, 3.0]]


def test_reference_block_cache_copies_and_swaps_exactly() -> None:
    from engine.interfaces.block_cache import KVCacheSpec

    attention = ReferenceAttentionBackend()
    pool = ReferenceBlockCache(KVCacheSpec(2, 1, 8, 4, torch.float32), 6, attention)
    for cache in pool.kv_caches:
        cache.copy_(torch.randn(cache.shape))
    before = [c.clone() for c in pool.kv_caches]
    pool.copy_blocks([(1, 4)])
    assert torch.equal(pool.kv_caches[1][:, 4], before[1][:, 1])
    pool.swap_out([(2, 0)])
    pool.kv_caches[0].zero_()
    pool.swap_in([(0, 5)])
    assert torch.equal(pool.kv_caches[0][:, 5], before[0][:, 2])
    with pytest.raises(ValueError, match="num_blocks"):
        ReferenceBlockCache(KVCacheSpec(1, 1, 8, 4, torch.float32), 0, attention)

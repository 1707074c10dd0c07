"""The shared Triton kernels against float64 references, on small shapes (interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from attention_cases import DECODE_LENS, MIXED_LENS, check, filled_problem, tuning

from engine_plugin_sdk.gpu.triton_kernels import INTERPRETER_TUNING, gemv_launchers, launchers
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

"""The FP8 throughput options: W8A8 weights quantized at load (``quantization="fp8"``) and an FP8 KV cache.

The GEMM runs on the CPU too (torch's scaled matmul), so CI checks it against a float64 reference of the
same quantization; the fused activation kernel, the FP8 cache and the engine runs need a GPU with FP8
units (Triton's interpreter converts to FP8 wrongly).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine_plugin_sdk import ACTIVATIONS_KEY, PER_TOKEN_ACTIVATIONS, KVCacheSpec, QuantizedWeight
from engine_plugin_sdk.quant import make_quantized_weight
from engine_plugin_sdk.reference_ops import ref_fused_add_rms_norm, ref_silu_and_mul
from engine_plugin_sdk.testing import build_tiny_llama
from engine_plugin_sdk.tolerances import compare, get_tolerance

HAS_GPU = torch.version.cuda is not None and torch.cuda.device_count() > 0
HAS_FP8 = HAS_GPU and torch.cuda.get_device_capability(0) >= (8, 9)
requires_fp8 = pytest.mark.skipif(not HAS_FP8, reason="needs an NVIDIA GPU with FP8 units (compute capability 8.9+)")


def load_time_fp8(out_features: int, in_features: int, seed: int, device: torch.device) -> QuantizedWeight:
    """A per-channel FP8 weight marked as the engine marks the ones it quantizes at load
    (``quantization="fp8"``): its activations may take one FP8 term per row (W8A8)."""
    qw = make_quantized_weight("fp8_e4m3", out_features, in_features, seed=seed, device=device)
    return dataclasses.replace(qw, extra={**qw.extra, ACTIVATIONS_KEY: PER_TOKEN_ACTIVATIONS})


def simulated_w8a8(x: torch.Tensor, qw, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 ``x @ W.T + b`` with ``x`` rounded to FP8 per row exactly as the kernel is specified to:
    a float32 scale and a float32 IEEE quotient (bf16 inputs often sit exactly on an FP8 rounding
    midpoint, where float64 arithmetic would round the other way)."""
    rows = x.reshape(-1, x.shape[-1]).float().cpu()
    scale = (rows.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
    xq = (rows / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale.double()
    y = xq @ qw.dequantize().double().cpu().T
    if bias is not None:
        y = y + bias.double().cpu()
    return y.reshape(*x.shape[:-1], -1)


def test_w8a8_gemm_matches_its_quantization(device: torch.device) -> None:
    from engine_plugin_nvidia.gemm import CudaGemmBackend, Fp8Weight

    gemm = CudaGemmBackend(device, fp8=True)
    gen = torch.Generator().manual_seed(21)
    qw = load_time_fp8(96, 256, seed=21, device=device)
    # a checkpoint's FP8 weight keeps the two-term activations; the load-time one asks for one term
    assert not gemm.prepare_weight(make_quantized_weight("fp8_e4m3", 96, 256, device=device), torch.float32).per_token_activations
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        prepared = gemm.prepare_weight(qw, dtype)
        assert isinstance(prepared, Fp8Weight) and prepared.per_token_activations
        x = (torch.randn(3, 5, 256, generator=gen) * torch.logspace(-2, 1, 5)[None, :, None]).to(dtype).to(device)
        bias = torch.randn(96, generator=gen).to(dtype).to(device)
        got = gemm.linear(x, prepared, bias)
        assert got.dtype == dtype and got.shape == (3, 5, 96)
        want = simulated_w8a8(x, qw, bias)
        # the GPU's row-wise scaled matmul writes bf16 whatever the activations' dtype
        tolerance = get_tolerance(torch.bfloat16 if device.type == "cuda" else dtype)
        assert not compare(got.cpu(), want, tolerance, f"w8a8 {dtype}")


@requires_fp8
def test_fused_activation_quantizer_matches_torch() -> None:
    from engine_plugin_sdk.gpu.fp8_gemm import quantize_rows
    from engine_plugin_sdk.gpu.triton_kernels.launchers import quantize_rows_fp8

    gen = torch.Generator().manual_seed(5)
    for k in (256, 4096, 14336):
        x = (torch.randn(37, k, generator=gen) * 3).to(torch.bfloat16).cuda()
        q, s = quantize_rows_fp8(x)
        q_ref, s_ref = quantize_rows(x)
        # torch divides by a scalar as a multiplication by its reciprocal on the GPU (an ulp apart from
        # the kernel's IEEE quotient), so values on an FP8 rounding midpoint (0.2% of bf16 inputs) may round
        # the other way
        torch.testing.assert_close(s, s_ref, rtol=2e-7, atol=0)
        same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
        assert same > 0.99, f"only {same:.4%} of the FP8 values agree at K={k}"
        # one FP8 step is at most 1/8 of the value (just above a power of two)
        torch.testing.assert_close(q.float() * s, q_ref.float() * s_ref, rtol=0.13, atol=1e-6)


@requires_fp8
def test_fused_fp8_producers_match_the_unfused_kernels() -> None:
    from engine_plugin_sdk.gpu.fp8_gemm import quantize_rows
    from engine_plugin_sdk.gpu.triton_kernels import fp8_launchers, launchers

    gen = torch.Generator().manual_seed(9)
    fp8 = torch.float8_e4m3fn

    def same_as(rows, data: torch.Tensor, scale: torch.Tensor, what: str) -> None:
        assert rows.data.dtype == fp8 and rows.dtype == torch.bfloat16 and rows.scale.shape == scale.shape
        torch.testing.assert_close(rows.scale, scale, rtol=2e-7, atol=0)
        agree = (rows.data.view(torch.uint8) == data.view(torch.uint8)).float().mean().item()
        assert agree > 0.99, f"{what}: only {agree:.4%} of the FP8 values agree"

    def close_to_reference(rows, ref: torch.Tensor) -> None:
        # the float64 reference, rounded to bf16 and quantized by torch, may round an input one bf16 step
        # the other way, which can move its FP8 value one step: 1/8 of a normal value, or a subnormal step
        # (2^-9 of the row's scale)
        data, scale = quantize_rows(ref.to(torch.bfloat16), fp8)
        atol = float(scale.max()) * 2.0**-8
        torch.testing.assert_close(rows.data.float() * rows.scale, data.float() * scale, rtol=0.13, atol=atol)

    for hidden, inter in ((4096, 14336), (200, 96)):
        x, residual, w = ((torch.randn(*shape, generator=gen) * 2).to(torch.bfloat16).cuda()
                          for shape in ((37, hidden), (37, hidden), (hidden,)))
        rows, summed = fp8_launchers.fused_add_rms_norm_fp8(x, residual, w, 1e-5, fp8)
        normed, want_sum = launchers.fused_add_rms_norm(x, residual, w, 1e-5)
        assert torch.equal(summed, want_sum)
        same_as(rows, *launchers.quantize_rows_fp8(normed), f"norm {hidden}")
        close_to_reference(rows, ref_fused_add_rms_norm(x, residual, w, 1e-5)[0])

        gate_up = (torch.randn(37, 2 * inter, generator=gen) * 2).to(torch.bfloat16).cuda()
        act = fp8_launchers.silu_and_mul_fp8(gate_up, fp8)
        same_as(act, *launchers.quantize_rows_fp8(launchers.silu_and_mul(gate_up)), f"silu {inter}")
        close_to_reference(act, ref_silu_and_mul(gate_up))
    with pytest.raises(ValueError, match="e4m3"):
        fp8_launchers.silu_and_mul_fp8(gate_up, torch.float8_e5m2)


@requires_fp8
def test_fp8_kv_cache_block_copies_and_swaps() -> None:
    from engine_plugin_nvidia.platform import CudaPlatform

    platform = CudaPlatform()
    assert "float8_e4m3fn" in platform.capabilities().kv_cache_dtypes
    backend = platform.make_attention_backend()
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float8_e4m3fn)
    pool = platform.make_block_cache(spec, 12, backend)
    assert pool.pool.dtype == torch.float8_e4m3fn
    for cache in pool.kv_caches:
        cache.copy_(torch.randn(cache.shape).to(torch.float8_e4m3fn))
    original = pool.pool.float().clone()
    pool.copy_blocks([(1, 2)])
    assert torch.equal(pool.pool[:, :, 2].float(), original[:, :, 1])
    pool.swap_out([(3, 0)])
    pool.swap_in([(0, 4)])
    assert torch.equal(pool.pool[:, :, 4].float(), original[:, :, 3])
    keys, values = backend.gather_kv(pool.kv_caches[0], [3, 1])
    assert torch.equal(keys[:16].float(), original[0, 0, 3].reshape(16, 2, 64))


def _first_token_logprobs(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[dict[int, float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    first = [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
    return tokens, first


@requires_fp8
@pytest.mark.parametrize("options", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}, {"quantization": "fp8", "kv_cache_dtype": "fp8"}])
def test_llm_fp8_modes_stay_close_to_bf16(tmp_path: Path, options: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tiny_llama(tmp_path, head_dim=128)
    # the suite's model has wide weights and logits in the tens, where FP8's relative rounding becomes
    # whole units of log-probability; HF's usual initialisation keeps them O(1), as a trained model's are
    config = LlamaConfig.from_pretrained(tmp_path)
    config.initializer_range = 0.05
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    prompts = [[1, 5, 9, 33, 7, 40, 41, 42], [1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [1, 100, 3, 17]]
    common = {"model": str(tmp_path), "device": "cuda", "dtype": "bfloat16", "kv_cache_memory_bytes": 32 * 2**20}
    base = LLM(**common)
    _, base_first = _first_token_logprobs(base, prompts)
    base_blocks = base.llm_engine.block_manager.num_total_blocks
    del base
    fp8 = LLM(**common, **options)
    tokens, first = _first_token_logprobs(fp8, prompts)
    if "kv_cache_dtype" in options:
        # the same budget holds twice the blocks
        assert fp8.llm_engine.block_manager.num_total_blocks == 2 * base_blocks
    if "quantization" in options:
        layer = fp8.llm_engine.model.layers[0]
        assert layer.qkv.per_token_activations and layer.down.data.dtype == torch.float8_e4m3fn
        assert fp8.llm_engine.model.lm_head.dtype == torch.bfloat16
        # the norms and the SwiGLU product write the W8A8 products' FP8 inputs themselves
        assert layer.qkv_fp8 == layer.gate_up_fp8 == layer.down_fp8 == torch.float8_e4m3fn
        assert fp8.llm_engine.model.ops.silu_and_mul_fp8.__module__.endswith("fp8_launchers")
    assert all(len(t) == 6 for t in tokens)
    # FP8 rounding moves the first token's log-probabilities a little (greedy choices may flip between
    # the random model's near-ties, so they are compared as log-probabilities, not as tokens): bf16's
    # choice stays among FP8's top five, and every token both top fives share moves by less than 0.3
    diffs = []
    for want, got in zip(base_first, first, strict=True):
        best = max(want, key=want.__getitem__)
        assert best in got, f"bf16's first choice {best} left the FP8 top five {sorted(got)}"
        diffs += [abs(got[t] - want[t]) for t in want.keys() & got.keys()]
    assert max(diffs) < 0.3, f"first-token log-probabilities moved by up to {max(diffs):.3f}"

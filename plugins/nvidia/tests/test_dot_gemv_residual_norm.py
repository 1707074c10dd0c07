"""The integer-dot GEMV taking the residual add and RMS norm before it (``GemmBackend.add_rms_norm_linear``), in its
programs (``dot_gemv_residual_norm``) or from a norm kernel that converts the row for it (``dot_gemv_prepared``):
against the norm kernel then the GEMV, through GGUF's 4-bit zero scales, 8-bit codes and GPTQ's one zero point,
gated and not, in bf16 and fp16, over one step and (the prepared row) several; the backend's fallback where the
kernel does not take the row (several rows, several steps)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_plugin_sdk.gpu.gemm import TorchGemmBackend
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_gemv_rows as gated_rows
from engine_plugin_sdk.gpu.triton_kernels import launchers
from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import SILU
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import (
    grouped_int_gated_linear,
    grouped_int_linear,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_norm_launchers import (
    grouped_int_add_rms_norm_linear,
    prepare_row,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import pack_grouped_codes, pack_grouped_int
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import (
    H200_GROUPED_INT_TILES,
    INTERPRETER_GROUPED_INT_TILES,
    GroupedIntTiles,
)
from engine_plugin_sdk.grouped_codes import GroupedCodes
from engine_plugin_sdk.quant import make_quantized_weight


def _tiles(device: torch.device, warps: int, on: bool = True, mode: str = "fused") -> GroupedIntTiles:
    """The tiles with the norm in the GEMV's programs (``mode`` "fused") or in a kernel that converts the row for it
    ("prepared"), or neither (not ``on``)."""
    base = INTERPRETER_GROUPED_INT_TILES if device.type == "cpu" else H200_GROUPED_INT_TILES
    return dataclasses.replace(
        base, dot_gemv_rows=8, dot_gemv_warps=warps, fragment_rows=0, dot_gemv_8bit=True, six_bit_codes=False,
        mma_asm=device.type != "cpu", dot_gemv_residual_norm=on and mode == "fused",
        dot_gemv_prepared=on and mode == "prepared",
    )  # fmt: skip


def _inputs(k: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(1, k, generator=gen).to(dtype).to(device)
    residual = (torch.randn(1, k, generator=gen) * 4).to(dtype).to(device)
    norm_weight = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(device)
    return x, residual, norm_weight


def _check(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    # the block-wide sum of squares runs in another order than the norm kernel's: the scale may differ in its
    # last bit, and so an activation by one unit of its 16-bit rounding
    assert got.shape == want.shape and got.dtype == want.dtype, label
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=label)
    assert (got == want).float().mean() > 0.9, label


@pytest.mark.parametrize("mode", ["fused", "prepared"])
@pytest.mark.parametrize(("dtype", "fill"), [(torch.bfloat16, 1.0), (torch.float16, 1.0), (torch.bfloat16, 0.75)])
def test_fused_norm_matches_the_norm_then_the_gemv(device, dtype, fill, mode) -> None:
    """Q4_K (zero scales, two-level), Q8_0 (8-bit codes) and GPTQ's form (one zero point), 37 outputs (a partial
    last program), with a bias, over one step (``fill``: the share of the step's slots the row fills, the rest
    masked): the sum stored is the norm kernel's, bit for bit, and the product the GEMV's over the norm kernel's
    output, with the norm in the GEMV's programs and with the row converted for them by the norm's kernel."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    warps = 4 if device.type == "cuda" else 1
    k4, k8 = int(1024 * warps * fill), int(512 * warps * fill)
    codes = torch.randint(0, 16, (37, k4), generator=gen, dtype=torch.uint8)
    gptq = GroupedCodes(codes, torch.rand(37, k4 // 128, generator=gen) * 0.05 + 0.001, None, 8, 4, 128, None)
    weights = {
        "gguf_q4_k": pack_grouped_int(make_quantized_weight("gguf_q4_k", 37, k4, seed=11), 32, device),
        "gguf_q8_0": pack_grouped_int(make_quantized_weight("gguf_q8_0", 37, k8, seed=12), 32, device),
        "gptq": pack_grouped_codes(gptq, 128, device),
    }
    tiles, off = _tiles(device, warps, mode=mode), _tiles(device, warps, on=False)
    for name, weight in weights.items():
        x, residual, norm_weight = _inputs(weight.shape[1], dtype, device, gen)
        bias = torch.randn(37, generator=gen).to(dtype).to(device)
        fused = grouped_int_add_rms_norm_linear(x, residual, norm_weight, 1e-5, weight, bias, tiles)
        assert fused is not None, name
        normed, summed = launchers.fused_add_rms_norm(x, residual, norm_weight, 1e-5)
        assert torch.equal(fused[1], summed), name
        assert torch.equal(residual, residual.clone()), name  # not written
        _check(fused[0], grouped_int_linear(normed, weight, bias, off), name)


@pytest.mark.parametrize("mode", ["fused", "prepared"])
def test_fused_norm_gated(device, mode) -> None:
    """A gate/up weight of 11 features, SiLU in the epilogue, GPTQ's form and Q4_K's."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    warps = 4 if device.type == "cuda" else 1
    k = 1024 * warps
    codes = torch.randint(0, 16, (22, k), generator=gen, dtype=torch.uint8)
    gptq = GroupedCodes(codes, torch.rand(22, k // 128, generator=gen) * 0.05 + 0.001, None, 8, 4, 128, None)
    tiles, off = _tiles(device, warps, mode=mode), _tiles(device, warps, on=False)
    for weight in (pack_grouped_codes(gptq, 128, device),
                   pack_grouped_int(make_quantized_weight("gguf_q4_k", 22, k, seed=13), 32, device)):  # fmt: skip
        x, residual, norm_weight = _inputs(k, torch.bfloat16, device, gen)
        fused = grouped_int_add_rms_norm_linear(x, residual, norm_weight, 1e-6, weight, None, tiles, SILU)
        assert fused is not None
        normed, summed = launchers.fused_add_rms_norm(x, residual, norm_weight, 1e-6)
        want = grouped_int_gated_linear(normed, weight, SILU, off)
        assert want is not None and fused[0].shape == (1, 11)
        assert torch.equal(fused[1], summed)
        _check(fused[0], want, "gated")


def _converted_reference(normed: torch.Tensor, block: int, bits: int) -> tuple[torch.Tensor, ...]:
    """The GEMV's conversion of a normalised row in float64: each slot's power of two ``2**(e - 141)`` from its
    largest magnitude's float32 exponent ``e`` (at least 19), the activations over it rounded half to even, the unit
    of their integer sums (over 16 for 4-bit codes) and their sum."""
    y = normed.double().reshape(-1)
    if bits == 8:
        slot_of = torch.arange(y.numel()) // 16
    else:
        col = torch.arange(y.numel())
        slot_of = (col // block) * (block // 32) + (col % (block // 2)) // 16
    slot_of = slot_of.to(y.device)
    slots = int(slot_of.max()) + 1
    big = torch.zeros(slots, dtype=torch.float64, device=y.device).scatter_reduce(0, slot_of, y.abs(), "amax")
    e = (big.float().view(torch.int32) >> 23).clamp(19, 254).double()
    ints = torch.round(y * torch.exp2(141 - e)[slot_of])
    unit = torch.exp2(e - (145 if bits == 4 else 141))
    total = torch.zeros(slots, dtype=torch.float64, device=y.device).index_add(0, slot_of, y)
    return ints, unit, total


@pytest.mark.parametrize(("kind", "k"), [("gptq", 1536), ("gguf_q4_k", 1024), ("gguf_q8_0", 768)])
def test_prepared_row_against_float64(device, kind, k) -> None:
    """The norm kernel's converted row (GPTQ's 128-column blocks over a row that is not a power of two wide, GGUF's
    32, 8-bit codes' runs of 16): the sum and the normalised row the norm kernel's, bit for bit; the int16
    activations and units exactly the float64 conversion's, the sums within float32 rounding."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    k *= 4 if device.type == "cuda" else 1
    if kind == "gptq":
        codes = torch.randint(0, 16, (8, k), generator=gen, dtype=torch.uint8)
        weight = pack_grouped_codes(GroupedCodes(codes, torch.rand(8, k // 128, generator=gen) + 0.1, None, 8, 4, 128,
                                                 None), 128, device)  # fmt: skip
    else:
        weight = pack_grouped_int(make_quantized_weight(kind, 8, k, seed=17), 32, device)
    for dtype in (torch.bfloat16, torch.float16):
        x, residual, norm_weight = _inputs(k, dtype, device, gen)
        summed = torch.empty_like(residual)
        converted, unit, total = prepare_row(x, residual, norm_weight, 1e-5, weight, summed)
        normed, want_summed = launchers.fused_add_rms_norm(x, residual, norm_weight, 1e-5)
        assert torch.equal(summed, want_summed)
        ints, want_unit, want_total = _converted_reference(normed, weight.block_k, weight.bits)
        assert torch.equal(converted.reshape(-1).double(), ints), (kind, dtype)
        assert torch.equal(unit.double(), want_unit), (kind, dtype)
        torch.testing.assert_close(total.double(), want_total, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ahead", [False, True])
def test_prepared_row_over_several_steps(device, ahead) -> None:
    """The prepared row where the GEMV's reduction takes several steps (a wider model's q/k/v and gate/up): two
    steps of GPTQ's form, 1.5 of Q4_K's (a masked last step) and two of Q8_0's, each step's operands read ahead of
    the one before or not; against the norm kernel then the GEMV."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    warps = 4 if device.type == "cuda" else 1
    codes = torch.randint(0, 16, (21, 2048 * warps), generator=gen, dtype=torch.uint8)
    gptq = GroupedCodes(codes, torch.rand(21, 16 * warps, generator=gen) * 0.05 + 0.001, None, 8, 4, 128, None)
    weights = {
        "gptq": pack_grouped_codes(gptq, 128, device),
        "gguf_q4_k": pack_grouped_int(make_quantized_weight("gguf_q4_k", 21, 1536 * warps, seed=15), 32, device),
        "gguf_q8_0": pack_grouped_int(make_quantized_weight("gguf_q8_0", 21, 1024 * warps, seed=16), 32, device),
    }
    tiles = dataclasses.replace(_tiles(device, warps, mode="prepared"), dot_gemv_ahead=ahead, dot_gemv_ahead_all=ahead)
    off = _tiles(device, warps, on=False)
    for name, weight in weights.items():
        x, residual, norm_weight = _inputs(weight.shape[1], torch.bfloat16, device, gen)
        prepared = grouped_int_add_rms_norm_linear(x, residual, norm_weight, 1e-5, weight, None, tiles)
        assert prepared is not None, name
        normed, summed = launchers.fused_add_rms_norm(x, residual, norm_weight, 1e-5)
        assert torch.equal(prepared[1], summed), name
        _check(prepared[0], grouped_int_linear(normed, weight, None, off), name)


def test_rows_the_kernel_does_not_take_fall_back(device) -> None:
    """Two rows, and a reduction of two steps, are declined by the launcher; the backend's
    ``add_rms_norm_linear`` then runs the norm and the product, and claims the fusion only with the tiles' flag."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    warps = 4 if device.type == "cuda" else 1
    tiles = _tiles(device, warps)
    weight = pack_grouped_int(make_quantized_weight("gguf_q4_k", 16, 2048 * warps, seed=14), 32, device)
    x, residual, norm_weight = _inputs(2048 * warps, torch.bfloat16, device, gen)
    assert grouped_int_add_rms_norm_linear(x, residual, norm_weight, 1e-5, weight, None, tiles) is None
    two = torch.cat([x, x])
    assert grouped_int_add_rms_norm_linear(two, torch.cat([residual] * 2), norm_weight, 1e-5, weight, None, tiles) is None
    backend = TorchGemmBackend(device)
    backend.triton_grouped_int = backend.triton_gated = True
    backend.grouped_int_tiles = _tiles(device, warps, on=False)
    assert not backend.fuses_residual_norm
    with pytest.raises(ValueError, match="does not fuse the residual norm"):
        backend.add_rms_norm_linear(x, residual, norm_weight, 1e-5, weight)
    backend.grouped_int_tiles = tiles
    assert backend.fuses_residual_norm
    out, summed = backend.add_rms_norm_linear(two, torch.cat([residual] * 2), norm_weight, 1e-5, weight)
    normed, want_summed = launchers.fused_add_rms_norm(two, torch.cat([residual] * 2), norm_weight, 1e-5)
    assert torch.equal(summed, want_summed)
    assert torch.equal(out, grouped_int_linear(normed, weight, None, tiles))
    assert gated_rows.NOT_GATED == -1


@pytest.mark.slow  # two engines in the interpreter
def test_a_gptq_llama_decodes_alike_with_the_norms_in_its_gemvs(tmp_path, monkeypatch) -> None:
    """A tiny GPTQ Llama (zero points, hidden 256) decoding one sequence in float16: every layer's norms but the
    first go into norm kernels that convert the row for the q/k/v and gate/up GEMVs (``dot_gemv_prepared``; the
    first layer's attention norm has no residual to add), and the greedy tokens and log-probabilities are those
    with the norms as their own launches."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: device cuda is not the interpreter here")
    from prequantized_checkpoints import write_gptq

    from engine import LLM, SamplingParams
    from engine_plugin_nvidia.platform import INTERPRET_ENV
    from engine_plugin_sdk.gpu.triton_kernels import grouped_int_norm_launchers, grouped_int_tiles
    from engine_plugin_sdk.testing import build_tiny_llama

    monkeypatch.setenv(INTERPRET_ENV, "1")
    # 17 tokens: the prompt's step takes the GEMM (in the interpreter, 2-16 rows take the fragment or tile kernel,
    # whose programs emulate the mma lane by lane, many times slower)
    prompt = [1, 5, 9, 33, 7, *range(60, 72)]
    plain = tmp_path / "plain"
    build_tiny_llama(plain, head_dim=64, seed=int(torch.randint(0, 1 << 20, ())))
    path, _ = write_gptq(str(plain), str(tmp_path / "gptq"), str(tmp_path / "reference"), bits=4, group=128,
                         symmetric=False, act_order=False)  # fmt: skip
    fused: list[int] = []

    def counted(*args, _real=grouped_int_norm_launchers.grouped_int_add_rms_norm_linear, **kwargs):
        result = _real(*args, **kwargs)
        fused.append(result is not None)
        return result

    monkeypatch.setattr(grouped_int_norm_launchers, "grouped_int_add_rms_norm_linear", counted)

    def decode(quantization: str) -> tuple[list[int], list[float]]:
        llm = LLM(model=path, device="cuda", dtype="float16", quantization=quantization, block_size=16,
                  max_num_seqs=1, max_model_len=64, kv_cache_memory_bytes=8 << 20)  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        llm.shutdown()
        return list(out.token_ids), [step[t].logprob for step, t in zip(out.logprobs, out.token_ids, strict=True)]

    interpreter = grouped_int_tiles.INTERPRETER_GROUPED_INT_TILES
    # the norm in the GEMV's programs is the interpreter's default (every packed model test there runs it) and the
    # prepared row gives its bits (test_fused_norm_matches_the_norm_then_the_gemv): the prepared row here
    prepared = dataclasses.replace(interpreter, dot_gemv_residual_norm=False, dot_gemv_prepared=True)
    monkeypatch.setattr(grouped_int_tiles, "INTERPRETER_GROUPED_INT_TILES", prepared)
    tokens, logprobs = decode("auto")
    layers = 2
    # per step (the prompt's rows declined, then 2 single rows): each layer's MLP norm and the second's attention
    # norm
    assert fused.count(True) == 2 * (2 * layers - 1) and fused.count(False) == 2 * layers - 1, fused
    off = dataclasses.replace(interpreter, dot_gemv_residual_norm=False)
    monkeypatch.setattr(grouped_int_tiles, "INTERPRETER_GROUPED_INT_TILES", off)
    fused.clear()
    unfused_tokens, unfused_logprobs = decode("auto")
    assert not fused
    # (the unfused packed path against the dequantized checkpoint is test_gptq_packed_model.py's)
    assert tokens == unfused_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(unfused_logprobs), atol=2e-3, rtol=0)

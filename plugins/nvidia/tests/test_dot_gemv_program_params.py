"""The integer-dot GEMV reading its group parameters from a program-order copy (``dot_gemv_program_params``):
the copy's row order, and the row-major parameters' bits through every form it takes (GGUF's K-quants with
their two-level scales, Q6_K's 8-bit codes, Q8_0, GPTQ's one zero point), gated and not, over one step and
several, with outputs the programs' rows do not divide."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import SILU
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import (
    grouped_int_gated_linear,
    grouped_int_linear,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import pack_grouped_codes, pack_grouped_int
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_program_params import program_params, program_rows
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import (
    H200_GROUPED_INT_TILES,
    INTERPRETER_GROUPED_INT_TILES,
    GroupedIntTiles,
)
from engine_plugin_sdk.grouped_codes import GroupedCodes
from engine_plugin_sdk.quant import make_quantized_weight

#: GGUF schemes the dot GEMV takes: Q4_K / Q5_K (zero scales, two-level), Q6_K (8-bit codes, two-level), Q8_0
#: (8-bit, one level), Q4_0 (4-bit codes with one zero point)
SCHEMES = {"gguf_q4_k": 32, "gguf_q5_k": 32, "gguf_q6_k": 16, "gguf_q8_0": 32, "gguf_q4_0": 32}


def _tiles(device: torch.device, rows: int, on: bool, warps: int = 1) -> GroupedIntTiles:
    base = INTERPRETER_GROUPED_INT_TILES if device.type == "cpu" else H200_GROUPED_INT_TILES
    return dataclasses.replace(
        base, dot_gemv_rows=rows, dot_gemv_warps=warps, fragment_rows=0, dot_gemv_8bit=True, six_bit_codes=False,
        gemv_gated_epilogue=True, mma_asm=device.type != "cpu", dot_gemv_program_params=on,
        dot_gemv_program_params_zero_point=on,
    )  # fmt: skip


def test_program_rows_follow_the_programs() -> None:
    """``R`` consecutive rows a program, the last repeated past the end; gated: ``R / 2`` features' gate rows then
    their up rows."""
    assert program_rows(5, 2, False).tolist() == [[0, 1], [2, 3], [4, 4]]
    assert program_rows(10, 4, True).tolist() == [[0, 1, 5, 6], [2, 3, 7, 8], [4, 4, 9, 9]]


def test_gguf_forms_give_the_row_major_bits(device) -> None:
    """Each scheme through one row, with a bias: the program-order copy gives the row-major parameters' bits, over
    1,024 columns at 8 rows a program (one step at 4 warps) and at 4 (one warp: two steps of 8-bit codes), and
    352 (a masked step), with 13 outputs (a partial last program)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    for scheme, block in SCHEMES.items():
        for k, warps in ((1024, 4), (1024, 1), (352, 1)):
            if k % 256 and "_k" in scheme:
                continue  # K-quants' super-blocks are 256 columns
            weight = pack_grouped_int(make_quantized_weight(scheme, 13, k, seed=int(gen.seed() % (1 << 30))), block,
                                      device)  # fmt: skip
            x = torch.randn(1, k, generator=gen).to(torch.bfloat16).to(device)
            bias = torch.randn(13, generator=gen).to(torch.bfloat16).to(device)
            rows = 8 if warps == 4 else 4
            want = grouped_int_linear(x, weight, bias, _tiles(device, rows, False, warps))
            got = grouped_int_linear(x, weight, bias, _tiles(device, rows, True, warps))
            assert torch.equal(got, want), (scheme, k, warps, rows)
            assert (rows, False) in weight.program_params, scheme


def test_gated_and_zero_point_forms_give_the_row_major_bits(device) -> None:
    """A gate/up weight of 5 features with its SiLU in the epilogue (zero scales, and GPTQ's one zero point with
    act-order over several steps, read ahead), and the copy kept by rows and gating."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    for zero_scales, perm, k in ((True, False, 256), (False, True, 2304)):
        codes = torch.randint(0, 16, (10, k), generator=gen, dtype=torch.uint8)
        scales = torch.rand(10, k // 128, generator=gen) * 0.05 + 0.001
        zs = torch.rand(10, k // 128, generator=gen) * 0.2 if zero_scales else None
        order = torch.randperm(k, generator=gen) if perm else None
        weight = pack_grouped_codes(GroupedCodes(codes, scales, zs, 0 if zero_scales else 8, 4, 128, order), 128,
                                    device)  # fmt: skip
        x = torch.randn(1, k, generator=gen).to(torch.float16).to(device)
        for rows in (8, 2):
            off, on = _tiles(device, rows, False), dataclasses.replace(_tiles(device, rows, True), dot_gemv_ahead=True)
            want = grouped_int_gated_linear(x, weight, SILU, dataclasses.replace(off, dot_gemv_ahead=True))
            got = grouped_int_gated_linear(x, weight, SILU, on)
            assert want is not None and torch.equal(got, want), (zero_scales, rows)
            assert torch.equal(grouped_int_linear(x, weight, None, on), grouped_int_linear(x, weight, None, off))
        assert set(weight.program_params) == {(8, True), (2, True), (8, False), (2, False)}
        assert program_params(weight, 8, True) is weight.program_params[(8, True)]


@pytest.mark.parametrize("scheme", ["gguf_q6_k", "gguf_q5_1", "gguf_q3_k"])
def test_six_bit_codes_give_the_row_major_bits(device, scheme: str) -> None:
    """6-bit codes read each slot's two halves' groups (Q6_K's two groups of 16 under one super-block; Q5_1's one
    group with its zero scale; Q3_K's two groups of 16): from the program-order copy they give the row-major
    parameters' bits, one step (1,024 columns at 4 warps) and several (at 1 warp), 14 outputs (7 features gated:
    partial last programs either way), gated and not."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    weight = pack_grouped_int(make_quantized_weight(scheme, 14, 1024, seed=int(gen.seed() % (1 << 30))), 16, device,
                              six_bit=True)  # fmt: skip
    assert weight.bits == 6
    x = torch.randn(1, 1024, generator=gen).to(torch.bfloat16).to(device)
    for warps, rows in ((4, 8), (1, 4)):
        off, on = _tiles(device, rows, False, warps), _tiles(device, rows, True, warps)
        off, on = (dataclasses.replace(t, six_bit_codes=True) for t in (off, on))
        assert torch.equal(grouped_int_linear(x, weight, None, on), grouped_int_linear(x, weight, None, off)), warps
        gated = grouped_int_gated_linear(x, weight, SILU, on)
        assert gated is not None and torch.equal(gated, grouped_int_gated_linear(x, weight, SILU, off)), warps
    assert {(8, False), (4, False), (8, True), (4, True)} <= set(weight.program_params)

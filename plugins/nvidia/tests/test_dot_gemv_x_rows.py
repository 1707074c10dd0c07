"""A few activation rows through the integer-dot GEMV (``GroupedIntTiles.dot_gemv_x_rows``): each row's programs
beside the others' over the same weight rows. Every form it takes (GGUF's K-quants with two-level scales, Q6_K in 8
and in 6 bits, Q8_0, Q4_0's zero point, GPTQ's act-order), gated and not, gives each row the bits that row gets on
its own, the rows read through their stride; and those rows take neither the fragment kernel nor the GEMM."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_plugin_sdk.gpu.triton_kernels import grouped_int_launchers as launchers
from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import SILU
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import (
    grouped_int_gated_linear,
    grouped_int_linear,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import pack_grouped_codes, pack_grouped_int
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import (
    H200_GROUPED_INT_TILES,
    INTERPRETER_GROUPED_INT_TILES,
    GroupedIntTiles,
)
from engine_plugin_sdk.grouped_codes import GroupedCodes
from engine_plugin_sdk.quant import make_quantized_weight

#: scheme, block, 6-bit codes, columns: two steps of 32 slots at one warp (a slot is 32 columns of 4- or 6-bit codes,
#: 16 of 8-bit ones; the second step masked)
FORMS = (("gguf_q4_k", 32, False, 1536), ("gguf_q6_k", 16, False, 768), ("gguf_q6_k", 16, True, 1536),
         ("gguf_q8_0", 32, False, 768), ("gguf_q4_0", 32, False, 1536))  # fmt: skip


def _tiles(device: torch.device, x_rows: int) -> GroupedIntTiles:
    base = INTERPRETER_GROUPED_INT_TILES if device.type == "cpu" else H200_GROUPED_INT_TILES
    return dataclasses.replace(
        base, dot_gemv_rows=4, dot_gemv_warps=1, dot_gemv_8bit=True, dot_gemv_x_rows=x_rows, dot_gemv_ahead=True,
        mma_asm=device.type != "cpu",
    )  # fmt: skip


@pytest.fixture
def no_other_kernels(monkeypatch):
    """Fails a product that takes the fragment kernel or the GEMM."""

    def refuse(*args, **kwargs):
        raise AssertionError("rows within dot_gemv_x_rows took another kernel")

    monkeypatch.setattr(launchers, "fragment_linear", refuse)
    monkeypatch.setattr(launchers, "_gemm", refuse)
    monkeypatch.setattr(launchers, "mma_linear", refuse)


def _seed() -> int:
    return int(torch.randint(0, 1 << 30, ()))


def test_each_row_gets_its_own_bits(device, no_other_kernels) -> None:
    """2 and 3 rows (the 3 a view of every other row of a wider batch: a stride of its own) with a bias, 9
    outputs (three programs a row, the last partial), over two steps and, for two forms, one (256 columns)."""
    gen = torch.Generator().manual_seed(_seed())
    for scheme, block, six, columns in FORMS:
        for k in (columns, 256) if scheme in ("gguf_q4_k", "gguf_q8_0") else (columns,):
            weight = pack_grouped_int(make_quantized_weight(scheme, 9, k, seed=_seed()), block, device, six_bit=six)
            bias = torch.randn(9, generator=gen).to(torch.bfloat16).to(device)
            wide = (torch.randn(6, k, generator=gen) * 2).to(torch.bfloat16).to(device)
            alone: dict[int, torch.Tensor] = {}  # each row of ``wide`` on its own (row 0 is in both batches)
            for x, picked in ((wide[:2], (0, 1)), (wide[::2], (0, 2, 4))):
                got = grouped_int_linear(x, weight, bias, _tiles(device, 4))
                for i, j in enumerate(picked):
                    if j not in alone:
                        alone[j] = grouped_int_linear(wide[j : j + 1].contiguous(), weight, bias, _tiles(device, 1))
                    assert torch.equal(got[i : i + 1], alone[j]), (scheme, six, k, x.shape, i)


def test_gated_rows_and_act_order(device, no_other_kernels) -> None:
    """GPTQ's one zero point with act-order, gated (SiLU in the epilogue, 5 features) and not, fp16 rows, over
    three steps read ahead (the last masked)."""
    gen = torch.Generator().manual_seed(_seed())
    k = 2304
    codes = torch.randint(0, 16, (10, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(10, k // 128, generator=gen) * 0.05 + 0.001
    weight = pack_grouped_codes(GroupedCodes(codes, scales, None, 8, 4, 128, torch.randperm(k, generator=gen)), 128,
                                device)  # fmt: skip
    x = torch.randn(3, k, generator=gen).to(torch.float16).to(device)
    gated = grouped_int_gated_linear(x, weight, SILU, _tiles(device, 3))
    plain = grouped_int_linear(x, weight, None, _tiles(device, 3))
    for i in range(3):
        row = x[i : i + 1]
        assert torch.equal(gated[i : i + 1], grouped_int_gated_linear(row, weight, SILU, _tiles(device, 1)))
        assert torch.equal(plain[i : i + 1], grouped_int_linear(row, weight, None, _tiles(device, 1)))


def test_more_rows_than_asked_take_the_other_kernels(device, monkeypatch) -> None:
    """Past ``dot_gemv_x_rows`` the rows go where they went before (here the GEMM: no fragment rows)."""
    calls = []
    monkeypatch.setattr(launchers, "dot_gemv", lambda *a, **kw: calls.append(a[0].shape[0]))
    weight = pack_grouped_int(make_quantized_weight("gguf_q8_0", 8, 256, seed=_seed()), 32, device)
    x = torch.randn(3, 256).to(torch.bfloat16).to(device)
    tiles = dataclasses.replace(_tiles(device, 2), fragment_rows=0)
    grouped_int_linear(x, weight, None, tiles)
    grouped_int_linear(x[:2], weight, None, tiles)
    assert calls == [2]


def test_several_rows_take_their_own_rows_a_program(device, monkeypatch) -> None:
    """``dot_gemv_x_rows_rows``: two activation rows launch 2 rows a program where one row takes 4 (gated too, the
    gate and up rows still paired), and each row keeps the bits it gets alone."""
    launched = []
    kernel = launchers.dot.grouped_int_dot_gemv_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(**kwargs):
                launched.append((kwargs.get("X_ROWS", 1), kwargs["ROWS"]))
                return kernel[grid](**kwargs)

            return launch

    monkeypatch.setattr(launchers.dot, "grouped_int_dot_gemv_kernel", Recording())
    gen = torch.Generator().manual_seed(_seed())
    weight = pack_grouped_int(make_quantized_weight("gguf_q4_k", 24, 256, seed=_seed()), 32, device)
    x = torch.randn(2, 256, generator=gen).to(torch.bfloat16).to(device)
    several = dataclasses.replace(_tiles(device, 2), dot_gemv_x_rows_rows=2)
    got = grouped_int_linear(x, weight, None, several)
    gated = grouped_int_gated_linear(x, weight, SILU, several)
    assert launched == [(2, 2), (2, 2)]
    for i in range(2):
        row = x[i : i + 1]
        assert torch.equal(got[i : i + 1], grouped_int_linear(row, weight, None, several))
        assert torch.equal(gated[i : i + 1], grouped_int_gated_linear(row, weight, SILU, several))
    assert launched[2:] == [(1, 4)] * 4
    assert launchers.dot_rows(weight, several, 2) == 2 and launchers.dot_rows(weight, several) == 4


@pytest.mark.parametrize(("scheme", "six"), [("gguf_q4_k", False), ("gguf_q6_k", True), ("gguf_q8_0", False)])
def test_rows_read_the_program_order_parameters(device, no_other_kernels, scheme, six) -> None:
    """``dot_gemv_x_rows_program_params``: 3 rows (3 programs of 4 weight rows each, 9 launch ids) read their weight
    rows' part of the program-order copy (two-level scales and zero scales for Q4_K, 6-bit codes for Q6_K), gated and
    not: each row's bits are those it gets alone and those of the row-major parameters."""
    gen = torch.Generator().manual_seed(_seed())
    weight = pack_grouped_int(make_quantized_weight(scheme, 12, 512, seed=_seed()), 16 if six else 32, device,
                              six_bit=six)  # fmt: skip
    x = (torch.randn(6, 512, generator=gen) * 2).to(torch.bfloat16).to(device)[::2]
    row_major = _tiles(device, 3)
    copied = dataclasses.replace(row_major, dot_gemv_program_params=True, dot_gemv_x_rows_program_params=True)
    for product in (lambda t, r: grouped_int_linear(r, weight, None, t),
                    lambda t, r: grouped_int_gated_linear(r, weight, SILU, t)):  # fmt: skip
        got = product(copied, x)
        assert torch.equal(got, product(row_major, x)), scheme
        for i in range(3):
            assert torch.equal(got[i : i + 1], product(copied, x[i : i + 1].contiguous())), (scheme, i)
    assert {(4, False), (4, True)} <= set(weight.program_params), weight.program_params.keys()

"""The gate/up product of 4-bit grouped weights with its gated activation in the kernel's epilogue
(``GemmBackend.gated_linear``): in the fragment kernel for a few bf16 / fp16 rows (lanes hold a feature's gate
and up rows side by side) and in the word and byte GEMVs for one row (a program's four rows are two features'
gate and up rows), so one launch writes ``act(gate) * up``. Against float64, in Triton's interpreter on the CPU (the
``mma`` emulated lane by lane) or on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_plugin_nvidia.gemm import CudaGemmBackend
from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_launchers as launchers
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import dequantize_packed, pack_grouped_codes
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import (
    H200_GROUPED_INT_TILES,
    INTERPRETER_GROUPED_INT_TILES,
)
from engine_plugin_sdk.grouped_codes import GroupedCodes
from engine_plugin_sdk.tolerances import compare, get_tolerance

#: the activations' reference formulas, float64
ACTIVATIONS = {
    "silu": lambda g: g * torch.sigmoid(g),
    "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
}


def _stacked_weight(
    features: int, in_features: int, zero_scales: bool, act_order: bool, device: torch.device, seed: int,
    group: int = 128, bits: int = 4,
) -> GroupedIntWeight:
    """A packed ``[2 * features, in_features]`` weight (gate rows over up rows) of ``bits``-bit codes in groups
    (and packed blocks) of ``group`` columns."""
    gen = torch.Generator().manual_seed(seed)
    rows, groups, top = 2 * features, in_features // group, 1 << bits
    codes = torch.randint(0, top, (rows, in_features), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(rows, groups, generator=gen) * 0.05 + 0.01) * 16 / top
    zs = torch.rand(rows, groups, generator=gen) * 0.2 if zero_scales else None
    perm = torch.randperm(in_features, generator=gen) if act_order else None
    unpacked = GroupedCodes(codes, scales, zs, 0 if zero_scales else top // 2, bits, group, perm)
    return pack_grouped_codes(unpacked, group, device)  # fmt: skip


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("zero_scales", "act_order"), [(False, True), (True, False)], ids=["gptq", "awq"])
def test_gated_fragment_product_matches_float64(
    device: torch.device, activation: str, zero_scales: bool, act_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1, 3 and 8 rows of bf16 / fp16 through the backend's ``gated_linear``: one fragment launch each (no
    separate activation kernel), equal to ``act(x @ G.T) * (x @ U.T)`` in float64 within the dtype's
    tolerance; 12 features (programs of 8), so the last program's gate and up rows run past the features' end."""
    seed = int(torch.randint(0, 1 << 30, ()))
    features, in_features = 12, 512
    weight = _stacked_weight(features, in_features, zero_scales, act_order, device, seed)
    gemm = CudaGemmBackend(device)
    tiles = INTERPRETER_GROUPED_INT_TILES if device.type == "cpu" else H200_GROUPED_INT_TILES
    gemm.triton_grouped_int = gemm.triton_gated = True
    gemm.grouped_int_tiles = dataclasses.replace(tiles, fragment_min_rows=1)
    launched = []
    real = launchers.fragment_linear
    monkeypatch.setattr(launchers, "fragment_linear", lambda *a: launched.append(a[5:]) or real(*a))
    dense = dequantize_packed(weight).double().cpu()
    gen = torch.Generator().manual_seed(seed + 1)
    for dtype in (torch.float16, torch.bfloat16):
        for rows in (1, 3, 8):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            got = gemm.gated_linear(x.to(device), weight, activation)
            assert got.shape == (rows, features) and got.dtype == dtype
            xs = x.double() if weight.perm is None else x.double()[:, weight.perm.cpu()]
            y = xs @ dense.T
            want = ACTIVATIONS[activation](y[:, :features]) * y[:, features:]
            problem = compare(got, want, get_tolerance(dtype), f"gated {activation} {dtype} M={rows}")
            assert not problem, problem
    # every call fused: the gated launch (its activation code as the extra argument), nothing else
    assert len(launched) == 6 and all(extra for extra in launched)


#: (zero scales, act-order, group, bits): the word GEMV's 4-bit codes in blocks of 128 (GPTQ, AWQ), the byte
#: GEMV's in blocks of 32 (GGUF's Q4_K repacked) and 8-bit codes
GEMV_WEIGHTS = [(False, True, 128, 4), (True, False, 128, 4), (True, False, 32, 4), (False, False, 64, 8)]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("zero_scales", "act_order", "group", "bits"), GEMV_WEIGHTS,
                         ids=["gptq", "awq", "q4k-blocks", "int8"])  # fmt: skip
def test_gated_gemv_matches_float64(
    device: torch.device, activation: str, zero_scales: bool, act_order: bool, group: int, bits: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """One row of bf16 / fp16 / float32 through ``gated_linear`` with the fragment kernel from two rows: the word
    or byte GEMV (four rows a program, as on the GPU) writes ``act(gate) * up`` itself; 7 features (four programs),
    so the last program's second feature is past the end."""
    seed = int(torch.randint(0, 1 << 30, ()))
    features, in_features = 7, 512
    weight = _stacked_weight(features, in_features, zero_scales, act_order, device, seed, group, bits)
    gemm = CudaGemmBackend(device)
    gemm.triton_grouped_int = gemm.triton_gated = True
    # a few iterations past the first tile in each GEMV
    gemm.grouped_int_tiles = dataclasses.replace(
        H200_GROUPED_INT_TILES, gemv=(4, 128, 4, 1), gemv4=(4, 128, 4, 1), mma_asm=device.type != "cpu",
        gemv_gated_epilogue=True, dot_gemv_rows=0,
    )
    launched = []
    real = launchers._gemv
    monkeypatch.setattr(launchers, "_gemv", lambda *a: launched.append(a[5:]) or real(*a))
    dense = dequantize_packed(weight).double().cpu()
    gen = torch.Generator().manual_seed(seed + 1)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.randn(1, in_features, generator=gen).to(dtype)
        got = gemm.gated_linear(x.to(device), weight, activation)
        assert got.shape == (1, features) and got.dtype == dtype
        xs = x.double() if weight.perm is None else x.double()[:, weight.perm.cpu()]
        y = xs @ dense.T
        want = ACTIVATIONS[activation](y[:, :features]) * y[:, features:]
        problem = compare(got, want, get_tolerance(dtype), f"gated GEMV {activation} {dtype}")
        assert not problem, problem
    assert len(launched) == 3 and all(extra for extra in launched)


def test_gated_product_falls_back_beyond_the_fragment_rows(device: torch.device) -> None:
    """Past the fragment kernel's rows (and with float32 activations) the product runs, then the activation:
    the same result as the fused launch."""
    weight = _stacked_weight(24, 256, False, False, device, seed=3)
    gemm = CudaGemmBackend(device)
    tiles = INTERPRETER_GROUPED_INT_TILES if device.type == "cpu" else H200_GROUPED_INT_TILES
    gemm.triton_grouped_int = gemm.triton_gated = True
    gemm.grouped_int_tiles = tiles
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 256, generator=gen).half().to(device)
    dense = dequantize_packed(weight).double().cpu()
    for rows in (x, x.float()):
        y = rows.double().cpu() @ dense.T
        want = ACTIVATIONS["silu"](y[:, :24]) * y[:, 24:]
        got = gemm.gated_linear(rows, weight, "silu")
        problem = compare(got, want, get_tolerance(rows.dtype), f"unfused {rows.dtype}")
        assert not problem, problem
    assert launchers.grouped_int_gated_linear(x, weight, 0, tiles) is None
    # two rows are fused (the fragment kernel); one 16-bit row by the integer-dot GEMV, but not on the word GEMV
    # (it ran slower with it), nor a float32 row
    assert launchers.grouped_int_gated_linear(x[:2], weight, 0, tiles) is not None
    assert launchers.grouped_int_gated_linear(x[:1], weight, 0, tiles) is not None
    assert launchers.grouped_int_gated_linear(x[:1].float(), weight, 0, tiles) is None
    words = dataclasses.replace(tiles, dot_gemv_rows=0)
    assert launchers.grouped_int_gated_linear(x[:1], weight, 0, words) is None


@pytest.mark.parametrize("wide_from", [3, 4], ids=["wide", "narrow"])
def test_one_row_of_a_wide_product_takes_the_fragment_kernel(
    device: torch.device, wide_from: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``fragment_wide_min_rows=1`` one row takes the fragment kernel (its gate/up product fused) where the
    product has at least ``fragment_narrow_programs`` programs of 16 features (48 features: 3), and the word
    GEMV (the activation after it) where it has fewer; both equal to float64."""
    weight = _stacked_weight(24, 256, False, True, device, seed=5)
    tiles = INTERPRETER_GROUPED_INT_TILES if device.type == "cpu" else H200_GROUPED_INT_TILES
    tiles = dataclasses.replace(
        tiles, fragment_min_rows=2, fragment_wide_min_rows=1, fragment_narrow_programs=wide_from, dot_gemv_rows=0
    )
    wide = wide_from == 3
    assert tiles.takes_fragments(1, 48) is wide and tiles.takes_fragments(2, 48)
    fragments, gemvs = [], []
    real_fragments, real_gemv = launchers.fragment_linear, launchers._gemv
    monkeypatch.setattr(launchers, "fragment_linear", lambda *a: fragments.append(a[5:]) or real_fragments(*a))
    monkeypatch.setattr(launchers, "_gemv", lambda *a: gemvs.append(a[5:]) or real_gemv(*a))
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    y = x.double()[:, weight.perm.cpu()] @ dequantize_packed(weight).double().cpu().T
    got = launchers.grouped_int_linear(x.to(device), weight, None, tiles)
    problem = compare(got, y, get_tolerance(torch.bfloat16), "one row")
    assert not problem, problem
    gated = launchers.grouped_int_gated_linear(x.to(device), weight, 0, tiles)
    if wide:
        problem = compare(gated, ACTIVATIONS["silu"](y[:, :24]) * y[:, 24:], get_tolerance(torch.bfloat16), "gated")
        assert not problem, problem
        assert len(fragments) == 2 and not gemvs and fragments[1]
    else:
        # the GEMV keeps the activation kernel (gemv_gated_epilogue off)
        assert gated is None and not fragments and len(gemvs) == 1

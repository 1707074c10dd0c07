"""The integer-dot GEMV (one bf16 / fp16 row over 4-bit codes, ``dp2a`` on the GPU, plain integer ops in the
interpreter) against float64: every block width, one zero point or zero scales, act-order, bias, masked tails,
its gated epilogue, and the exactness of its 16-bit activations."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_plugin_sdk.gpu.triton_kernels import grouped_int_launchers as launchers
from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import GELU_TANH, SILU
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_products import _dot8_asm, _dot_asm
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import (
    grouped_int_gated_linear,
    grouped_int_linear,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import dequantize_packed, pack_grouped_codes
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import (
    H200_GROUPED_INT_TILES,
    INTERPRETER_GROUPED_INT_TILES,
    GroupedIntTiles,
)
from engine_plugin_sdk.grouped_codes import GroupedCodes
from engine_plugin_sdk.tolerances import compare, get_tolerance

#: (block and group, zero scales, act-order, in_features, out_features): blocks of 128 / 64 / 32 columns,
#: reductions the 32 * warps slots of a step do not divide, outputs the rows of a program do not divide
CASES = [(128, False, False, 512, 8), (128, True, True, 384, 6), (32, True, False, 224, 5), (64, False, True, 320, 3),
         (128, False, False, 2048, 4), (32, True, True, 2304, 3)]  # fmt: skip
#: (the last two take several 32-slot steps: two exactly, and two and a quarter)


#: 8-bit codes: (group, zero scales, act-order, in_features, out_features): Q6_K's 16-column groups with a zero
#: point of 32, Q8_0's 32 with 128, 8-bit GPTQ's 128 with zero scales and act-order
CASES8 = [(16, False, False, 208, 5), (32, False, False, 256, 8), (128, True, True, 384, 3), (16, False, False, 1024, 3),
          (32, True, True, 1184, 2)]  # fmt: skip


def _tiles(device: torch.device, rows: int, warps: int = 1, ahead: bool = False) -> GroupedIntTiles:
    base = INTERPRETER_GROUPED_INT_TILES if device.type == "cpu" else H200_GROUPED_INT_TILES
    return dataclasses.replace(base, dot_gemv_rows=rows, dot_gemv_warps=warps, fragment_rows=0, dot_gemv_8bit=True,
                               dot_gemv_ahead=ahead, dot_gemv_ahead_all=ahead, mma_asm=device.type != "cpu")  # fmt: skip


def _weight(gen: torch.Generator, block: int, zero_scales: bool, perm: bool, k: int, n: int, device: torch.device,
            bits: int = 4):  # fmt: skip
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // block, generator=gen) * (0.05 if bits == 4 else 0.004) + 0.001
    zs = torch.rand(n, k // block, generator=gen) * 0.2 if zero_scales else None
    order = torch.randperm(k, generator=gen) if perm else None
    zero = 0 if zero_scales else {4: 8, 8: 32 if block == 16 else 128}[bits]
    unpacked = GroupedCodes(codes, scales, zs, zero, bits, block, order)
    return pack_grouped_codes(unpacked, min(block, 128), device), order


def _reference(x: torch.Tensor, weight, order: torch.Tensor | None) -> torch.Tensor:
    xs = x.double().cpu()
    return (xs if order is None else xs[:, order]) @ dequantize_packed(weight).double().cpu().T


def _check_cases(device, cases, bits: int, rows: int, ahead: bool, seed: int) -> None:
    """Each case's weight against float64 in bf16 and fp16 with a bias, through :func:`grouped_int_linear`; and
    its float32 outputs within the 16-bit activations' bound (each activation within 2**-16 of the largest:
    2**-14 of the largest times a row's absolute sum)."""
    gen = torch.Generator().manual_seed(seed)
    for block, zero_scales, perm, k, n in cases:
        weight, order = _weight(gen, block, zero_scales, perm, k, n, device, bits)
        for dtype in (torch.bfloat16, torch.float16):
            # activations over four decades, in a random order: slots mix large and small ones
            x = (torch.randn(1, k, generator=gen) * torch.logspace(-3, 1, k)[torch.randperm(k, generator=gen)]).to(dtype)
            bias = torch.randn(n, generator=gen).to(dtype)
            want = _reference(x, weight, order)
            what = f"{bits}-bit block {block} zs={zero_scales} perm={perm} {dtype} rows={rows} ahead={ahead}"
            got = grouped_int_linear(x.to(device), weight, bias.to(device), _tiles(device, rows, ahead=ahead))
            assert got.dtype == dtype and got.shape == (1, n)
            problem = compare(got, want + bias.double(), get_tolerance(dtype), what)
            assert not problem, problem
            exact = grouped_int_linear(x.to(device), weight, None, _tiles(device, rows), torch.float32).double().cpu()
            bound = 2.0**-14 * float(x.abs().max()) * float(dequantize_packed(weight).abs().sum(1).max())
            assert float((exact - want).abs().max()) <= bound, what


@pytest.mark.parametrize(("rows", "ahead"), [(1, False), (2, True), (4, False), (8, True)])
def test_dot_gemv_matches_float64(device, rows: int, ahead: bool, monkeypatch) -> None:
    """Every block width, zero point and zero scales, act-order and bias, with and without the words read a
    step ahead (several steps a reduction: one warp's 32 slots a step; on zero scales too, ``dot_gemv_ahead_all``)."""
    calls = []
    monkeypatch.setattr(launchers, "dot_gemv", lambda *a, _real=launchers.dot_gemv: calls.append(1) or _real(*a))
    _check_cases(device, CASES, 4, rows, ahead, 101 + rows)
    assert len(calls) == 2 * 2 * len(CASES)


@pytest.mark.parametrize(("rows", "ahead"), [(1, True), (8, False)])
def test_dot_gemv_takes_8_bit_codes(device, rows: int, ahead: bool, monkeypatch) -> None:
    """8-bit codes (``dot_gemv_8bit``) in groups of 16, 32 and 128 columns, a zero point or zero scales with
    act-order; without the switch they take the byte GEMV."""
    calls = []
    monkeypatch.setattr(launchers, "dot_gemv", lambda *a, _real=launchers.dot_gemv: calls.append(1) or _real(*a))
    _check_cases(device, CASES8, 8, rows, ahead, 301 + rows)
    assert len(calls) == 2 * 2 * len(CASES8)
    weight, _ = _weight(torch.Generator().manual_seed(3), 32, False, False, 256, 4, device, bits=8)
    off = dataclasses.replace(_tiles(device, rows), dot_gemv_8bit=False)
    grouped_int_linear(torch.randn(1, 256).to(device, torch.float16), weight, None, off)
    assert len(calls) == 2 * 2 * len(CASES8)


def test_read_ahead_only_for_4_bit_codes_with_one_zero_point(device) -> None:
    """``dot_gemv_ahead`` reads a step's operands ahead for GPTQ / AWQ's form only: zero scales (GGUF's K-quants)
    ran slower with it, and 8-bit codes (Q4_K_M's Q6_K tensors) were only timed in that losing mix."""
    gen = torch.Generator().manual_seed(5)
    tiles = dataclasses.replace(_tiles(device, 8), dot_gemv_ahead=True)
    one_zero, _ = _weight(gen, 128, False, False, 256, 4, device)
    zero_scales, _ = _weight(gen, 32, True, False, 256, 4, device)
    eight_bit, _ = _weight(gen, 32, False, False, 256, 4, device, bits=8)
    assert launchers._dot_ahead(one_zero, tiles)
    assert not launchers._dot_ahead(zero_scales, tiles) and not launchers._dot_ahead(eight_bit, tiles)
    assert not launchers._dot_ahead(one_zero, _tiles(device, 8, ahead=False))
    every = dataclasses.replace(tiles, dot_gemv_ahead_all=True)
    assert launchers._dot_ahead(zero_scales, every) and launchers._dot_ahead(eight_bit, every)


def test_scales_after_the_wait_by_form(device) -> None:
    """GPTQ / AWQ's form (4-bit codes, one zero point) reads its first scales before the PDL wait by
    ``dot_gemv_early_zero_point_params`` (after it on the H200's tiles: W4A16 decode +1.5%), every other form by
    ``dot_gemv_early_params`` (before: GGUF Q4_K_M lost 7% after it)."""
    gen = torch.Generator().manual_seed(7)
    one_zero, _ = _weight(gen, 128, False, False, 256, 4, device)
    zero_scales, _ = _weight(gen, 32, True, False, 256, 4, device)
    eight_bit, _ = _weight(gen, 32, False, False, 256, 4, device, bits=8)
    h200 = H200_GROUPED_INT_TILES
    assert not launchers._dot_early_params(one_zero, h200)
    assert launchers._dot_early_params(zero_scales, h200) and launchers._dot_early_params(eight_bit, h200)
    flipped = dataclasses.replace(h200, dot_gemv_early_zero_point_params=True, dot_gemv_early_params=False)
    assert launchers._dot_early_params(one_zero, flipped)
    assert not launchers._dot_early_params(zero_scales, flipped) and not launchers._dot_early_params(eight_bit, flipped)


@pytest.mark.parametrize(
    "change",
    [{"dot_gemv_early_params": False, "dot_gemv_early_zero_point_params": False},
     {"dot_gemv_early_params": False, "dot_gemv_early_zero_point_params": False, "dot_gemv_prefetch_params": True},
     {"dot_gemv_max_registers": 80}],
    ids=["late", "late-prefetched", "capped"],
)  # fmt: skip
def test_group_parameters_read_after_the_wait_give_the_same_bits(device, change: dict) -> None:
    """``dot_gemv_early_params`` off (the first step's scales read after the PDL wait, their L2 lines asked for
    before it with ``dot_gemv_prefetch_params``), or a cap on the registers (on the GPU: spills): every 4- and
    8-bit case gives the default's bits."""
    gen = torch.Generator().manual_seed(17)
    late = dataclasses.replace(_tiles(device, 8), **change)
    for bits, cases in ((4, CASES), (8, CASES8)):
        for block, zero_scales, perm, k, n in cases:
            weight, _ = _weight(gen, block, zero_scales, perm, k, n, device, bits)
            x = (torch.randn(1, k, generator=gen) * 3).to(torch.bfloat16).to(device)
            want = grouped_int_linear(x, weight, None, _tiles(device, 8))
            assert torch.equal(grouped_int_linear(x, weight, None, late), want), (bits, block, zero_scales, perm)


@pytest.mark.parametrize("groups", [3])  # 2 is the same code path with whole groups; 3 leaves partial ones
def test_row_groups_give_the_same_bits(device, groups: int) -> None:
    """``dot_gemv_row_groups``: a program taking several groups of rows one after another (single-step products:
    each case's reduction within one warp's 32 slots, or several steps, where the groups do not apply) gives the
    one-group program's bits, with a bias, on a gate/up weight with its activation, and where the outputs leave
    the last program's groups partly or wholly past the end."""
    gen = torch.Generator().manual_seed(29 + groups)
    for bits, cases in ((4, CASES), (8, CASES8)):
        for block, zero_scales, perm, k, n in cases:
            # 2n + 1 outputs: the last program's three groups of 2 rows hold 1, 3 or 5 of them (over the cases),
            # so a group is cut and the groups after it lie wholly past the end
            weight, _ = _weight(gen, block, zero_scales, perm, k, 2 * n + 1, device, bits)
            x = (torch.randn(1, k, generator=gen) * 3).to(torch.bfloat16).to(device)
            bias = torch.randn(2 * n + 1, generator=gen).to(torch.bfloat16).to(device)
            one = _tiles(device, 2)
            many = dataclasses.replace(one, dot_gemv_row_groups=groups)
            want = grouped_int_linear(x, weight, bias, one)
            assert torch.equal(grouped_int_linear(x, weight, bias, many), want), (bits, block, k, n)
    weight, _ = _weight(gen, 128, True, False, 256, 2 * 7, device)
    x = torch.randn(1, 256, generator=gen).to(torch.float16).to(device)
    one = dataclasses.replace(_tiles(device, 2), gemv_gated_epilogue=True)
    gated = grouped_int_gated_linear(x, weight, SILU, one)
    assert torch.equal(grouped_int_gated_linear(x, weight, SILU, dataclasses.replace(one, dot_gemv_row_groups=groups)),
                       gated)  # fmt: skip


def test_narrow_products_take_their_own_rows(device) -> None:
    """``dot_gemv_narrow_rows``: products of at most ``dot_gemv_narrow_max`` output rows take that many rows a
    program, wider ones ``dot_gemv_rows``; each gives the bits of the other row count (4- and 8-bit codes)."""
    gen = torch.Generator().manual_seed(31)
    for bits, (block, zero_scales, perm, k, n) in ((4, CASES[0]), (8, CASES8[1])):
        weight, _ = _weight(gen, block, zero_scales, perm, k, 2 * n + 1, device, bits)
        x = (torch.randn(1, k, generator=gen) * 3).to(torch.bfloat16).to(device)
        eight = _tiles(device, 8)
        narrow = dataclasses.replace(eight, dot_gemv_narrow_rows=2, dot_gemv_narrow_max=2 * n + 1)
        assert launchers.dot_rows(weight, narrow) == 2
        assert launchers.dot_rows(weight, dataclasses.replace(narrow, dot_gemv_narrow_max=2 * n)) == 8
        assert torch.equal(grouped_int_linear(x, weight, None, narrow), grouped_int_linear(x, weight, None, eight))


def test_vector_masks_give_the_same_bits(device) -> None:
    """``dot_gemv_vector_masks``: a reduction the steps do not divide (a masked last step), read ahead and not, 4-
    and 8-bit codes (with act-order's permutation, whose gathered pairs it leaves alone), gives the bits without it."""
    gen = torch.Generator().manual_seed(37)
    for bits, cases in ((4, CASES), (8, CASES8)):
        for block, zero_scales, perm, k, n in cases:
            weight, _ = _weight(gen, block, zero_scales, perm, k, n, device, bits)
            x = (torch.randn(1, k, generator=gen) * 3).to(torch.bfloat16).to(device)
            for ahead in (False, True):
                plain = _tiles(device, 4, ahead=ahead)
                vector = dataclasses.replace(plain, dot_gemv_vector_masks=True)
                want = grouped_int_linear(x, weight, None, plain)
                assert torch.equal(grouped_int_linear(x, weight, None, vector), want), (bits, block, k, ahead)


def test_activations_within_2_7_of_their_slot_maximum_are_exact(device) -> None:
    """bf16 activations whose 32-column slots span less than 2**7 become 16-bit integers exactly: the product
    is float64's to float32 sums' rounding (a wrong code-to-activation pairing is far off)."""
    gen = torch.Generator().manual_seed(7)
    weight, _ = _weight(gen, 128, False, False, 512, 8, device)
    for warps in (1, 2):
        # magnitudes in [1, 64) with random signs, each slot with its own scale
        x = torch.exp2(torch.randint(0, 6, (1, 512), generator=gen).float()) * (1 + torch.rand(1, 512, generator=gen))
        x = (x * torch.where(torch.rand(1, 512, generator=gen) < 0.5, -1.0, 1.0)).to(torch.bfloat16)
        x = x * torch.exp2(torch.randint(-20, 20, (1, 16), generator=gen).float()).repeat_interleave(32, 1).bfloat16()
        got = grouped_int_linear(x.to(device), weight, None, _tiles(device, 4, warps), torch.float32).double().cpu()
        want = _reference(x, weight, None)
        magnitude = x.double().abs() @ dequantize_packed(weight).double().abs().cpu().T
        assert bool(((got - want).abs() <= 4e-6 * magnitude).all()), (got - want).abs() / magnitude


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_non_finite_activations_give_non_finite_rows(device, bad: float) -> None:
    """An infinity or a NaN among the activations is not rounded away with the rest of its slot (codes with a
    zero point of 0: no activation sum carries it either)."""
    gen = torch.Generator().manual_seed(9)
    for bits, block in ((4, 128), (8, 16)):
        codes = torch.randint(1, 1 << bits, (8, 256), generator=gen, dtype=torch.uint8)
        scales = torch.rand(8, 256 // block, generator=gen) + 0.1
        weight = pack_grouped_codes(GroupedCodes(codes, scales, None, 0, bits, block), block, device)
        x = torch.randn(1, 256, generator=gen)
        x[0, 37] = bad
        got = grouped_int_linear(x.to(device, torch.bfloat16), weight, None, _tiles(device, 4))
        assert not bool(torch.isfinite(got.float()).any()), (bits, got)


@pytest.mark.parametrize("activation", [SILU, GELU_TANH], ids=["silu", "gelu-tanh"])
def test_gated_dot_gemv_fuses_the_activation(device, activation: int) -> None:
    """A gate/up weight through the integer-dot GEMV with its activation in the epilogue (``gemv_gated_epilogue``)
    gives ``act(gate) * up`` of the float64 products; odd feature counts leave a partial last program."""
    gen = torch.Generator().manual_seed(11 + activation)
    features, k = 7, 256
    weight, _ = _weight(gen, 128, True, False, k, 2 * features, device)
    for rows in (2, 4, 8):
        tiles = dataclasses.replace(_tiles(device, rows), gemv_gated_epilogue=True)
        x = torch.randn(1, k, generator=gen).to(torch.float16)
        got = grouped_int_gated_linear(x.to(device), weight, activation, tiles)
        assert got is not None and got.shape == (1, features)
        y = _reference(x, weight, None)
        gate, up = y[:, :features], y[:, features:]
        act = gate * torch.sigmoid(gate) if activation == SILU else torch.nn.functional.gelu(gate, approximate="tanh")
        problem = compare(got, act * up, get_tolerance(torch.float16), f"gated rows={rows}")
        assert not problem, problem
    # an odd number of rows a program cannot pair gate and up rows: the product and the activation run apart
    assert grouped_int_gated_linear(x.to(device), weight, activation, _tiles(device, 1)) is None


def test_dot_gemv_refuses_other_row_counts(device) -> None:
    gen = torch.Generator().manual_seed(3)
    weight, _ = _weight(gen, 128, False, False, 256, 4, device)
    with pytest.raises(ValueError, match="a power of two rows a program, up to 64"):
        grouped_int_linear(torch.randn(1, 256).to(device, torch.float16), weight, None, _tiles(device, 3))


def test_dot8_asm_takes_each_word_against_its_two_pairs() -> None:
    """8-bit codes: word ``j`` (``$4 + j``, columns ``4j .. 4j + 3``) meets pairs ``2j`` (bytes 0, 1) and ``2j + 1``
    (bytes 2, 3), registers ``$8 + 2j`` and ``$9 + 2j``, as it is (no mask)."""
    asm = _dot8_asm()
    assert asm.count("dp2a.") == 8 and "and.b32" not in asm
    for j in range(4):
        assert f"dp2a.lo.s32.u32 s, ${8 + 2 * j}, ${4 + j}, s;" in asm
        assert f"dp2a.hi.s32.u32 s, ${9 + 2 * j}, ${4 + j}, s;" in asm


def test_dot_asm_pairs_each_word_with_its_columns() -> None:
    """Word ``j`` of the four (``$4 + j``) meets the pairs of columns ``4j, 4j+1`` and ``4j+2, 4j+3``: registers
    ``$8 + 2j`` and ``$9 + 2j`` for its low nibbles, 8 further on for its high ones; 16 ``dp2a`` in all."""
    asm = _dot_asm()
    assert asm.count("dp2a.") == 16
    for j in range(4):
        assert f"and.b32 l, ${4 + j}, 0x0F0F0F0F;" in asm and f"and.b32 h, ${4 + j}, 0xF0F0F0F0;" in asm
        block = asm.split(f"and.b32 l, ${4 + j}, 0x0F0F0F0F;")[1].split("and.b32 l,")[0]
        assert f"dp2a.lo.s32.u32 sl, ${8 + 2 * j}, l, sl;" in block
        assert f"dp2a.hi.s32.u32 sl, ${9 + 2 * j}, l, sl;" in block
        assert f"dp2a.lo.s32.u32 sh, ${16 + 2 * j}, h, sh;" in block
        assert f"dp2a.hi.s32.u32 sh, ${17 + 2 * j}, h, sh;" in block

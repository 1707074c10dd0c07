"""8-bit codes that fit 6 bits (GGUF's Q6_K, and its Q5 types) kept in 6 on GPUs (``GroupedIntTiles.six_bit_codes``): their low
nibbles as 4-bit codes over blocks of 32 columns and a plane of their high bits. The packing is exact and takes
the file's size; the integer-dot GEMV (one 16-bit row; ``dp2a`` PTX on the GPU, plain integer ops in the
interpreter, the PTX itself run by :mod:`ptx_emulator`), the GEMM and the dequantized copy multiply them as
float64 does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from ptx_emulator import run_ptx

from engine_plugin_sdk.gpu.triton_kernels import grouped_int_launchers as launchers
from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import SILU
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_products import _dot6_asm, _dot8_asm, _dot_asm
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import (
    grouped_int_gated_linear,
    grouped_int_linear,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import (
    dequantize_packed,
    pack_grouped_codes,
    pack_grouped_int,
    six_bit_codes,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import (
    H200_GROUPED_INT_TILES,
    INTERPRETER_GROUPED_INT_TILES,
)
from engine_plugin_sdk.grouped_codes import GroupedCodes, grouped_codes
from engine_plugin_sdk.quant import make_quantized_weight
from engine_plugin_sdk.tolerances import compare, get_tolerance

CPU = torch.device("cpu")


def fresh_seed() -> int:
    return int(torch.randint(0, 1 << 30, ()))


def _tiles(device: torch.device, rows: int, six_rows: int = 0):
    base = INTERPRETER_GROUPED_INT_TILES if device.type == "cpu" else H200_GROUPED_INT_TILES
    return dataclasses.replace(base, dot_gemv_rows=rows, dot_gemv_six_bit_rows=six_rows, dot_gemv_warps=1,
                               six_bit_codes=True, mma_asm=device.type != "cpu")  # fmt: skip


def _q6_k(n: int, k: int, device: torch.device, seed: int):
    weight = make_quantized_weight("gguf_q6_k", n, k, seed=seed)
    return pack_grouped_int(weight, 16, device, six_bit=True), None


def _synthetic(gen: torch.Generator, group: int, zero_scales: bool, perm: bool, k: int, n: int, device):
    """6-bit codes in 8-bit storage with one-level scales: zero scales or Q6_K's zero point, act-order or not."""
    codes = torch.randint(0, 64, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.004 + 0.001
    zs = torch.rand(n, k // group, generator=gen) * 0.2 if zero_scales else None
    order = torch.randperm(k, generator=gen) if perm else None
    unpacked = GroupedCodes(codes, scales, zs, 0 if zero_scales else 32, 8, group, order)
    return pack_grouped_codes(unpacked, 16, device, six_bit=True), order


def _reference(x: torch.Tensor, weight, order: torch.Tensor | None) -> torch.Tensor:
    xs = x.double().cpu()
    return (xs if order is None else xs[:, order]) @ dequantize_packed(weight).double().cpu().T


def _weights(device: torch.device, seed: int) -> list[tuple[str, object, torch.Tensor | None]]:
    """Q6_K (two-level scales) over reductions of one masked step, several exact steps and a masked tail (one
    warp's 32 blocks a step), Q5_K / Q5_0 / Q5_1, and one-level forms: groups of 16 with a zero point, 32 with zero scales and
    act-order, 64 with a zero point; output counts the rows of a program do not divide."""
    gen = torch.Generator().manual_seed(seed)
    weights = [(f"q6_k k={k}", *_q6_k(n, k, device, seed + k)) for k, n in ((512, 5), (2048, 4), (2304, 3))]
    # 5-bit GGUF types: Q5_K's two-level zero scales, Q5_0's zero point of 16, Q5_1's one-level zero scales
    for scheme, k, n in (("gguf_q5_k", 512, 3), ("gguf_q5_0", 320, 2), ("gguf_q5_1", 1056, 3)):
        weight = make_quantized_weight(scheme, n, k, seed=seed + 7)
        weights.append((scheme, pack_grouped_int(weight, 16, device, six_bit=True), None))
    for group, zero_scales, perm, k, n in ((16, False, False, 224, 3), (32, True, True, 320, 5), (64, False, True, 1088, 2)):
        weights.append((f"group {group} zs={zero_scales} perm={perm}", *_synthetic(gen, group, zero_scales, perm, k, n, device)))
    for _, weight, _ in weights:
        assert weight.bits == 6 and weight.block_k == 32
    return weights


def test_q6_k_packs_exactly_to_its_file_size() -> None:
    weight = make_quantized_weight("gguf_q6_k", 24, 1024, seed=fresh_seed())
    codes = grouped_codes(weight, CPU).codes
    for two_level in (True, False):
        six = pack_grouped_int(weight, 16, CPU, two_level=two_level, six_bit=True)
        assert six.bits == 6 and six.codes.shape == (24, 512) and six.high_bits.shape == (24, 256)
        assert torch.equal(six_bit_codes(six), codes) and torch.equal(dequantize_packed(six), weight.dequantize())
    # with its two-level scales, exactly the GGUF file's bytes (8-bit codes: 1.31x)
    assert six.nbytes > weight.data.numel()
    assert pack_grouped_int(weight, 16, CPU, six_bit=True).nbytes == weight.data.numel()
    assert pack_grouped_int(weight, 16, CPU).nbytes == pytest.approx(weight.data.numel() * 1.31, rel=0.01)


def test_each_code_sits_where_the_layout_says() -> None:
    """Column ``32 b + 16 h + 4 i + k``: low nibble in nibble ``h`` of byte ``16 b + 4 i + k``; high bits at bits
    ``2 i`` of plane byte ``8 b + 4 h + k``."""
    weight = make_quantized_weight("gguf_q6_k", 3, 256, seed=fresh_seed())
    six = pack_grouped_int(weight, 16, CPU, six_bit=True)
    codes = grouped_codes(weight, CPU).codes.long()
    b, h, i, k = np.meshgrid(range(8), range(2), range(4), range(4), indexing="ij")
    col = torch.as_tensor((32 * b + 16 * h + 4 * i + k).ravel())
    nibble = (six.codes.long()[:, torch.as_tensor((16 * b + 4 * i + k).ravel())] >> torch.as_tensor(4 * h.ravel())) & 0xF
    high = (six.high_bits.long()[:, torch.as_tensor((8 * b + 4 * h + k).ravel())] >> torch.as_tensor(2 * i.ravel())) & 3
    assert torch.equal(nibble | (high << 4), codes[:, col])


def test_codes_needing_8_bits_stay_8_bit() -> None:
    q8 = make_quantized_weight("gguf_q8_0", 4, 256, seed=fresh_seed())
    assert pack_grouped_int(q8, 16, CPU, six_bit=True).bits == 8
    codes = torch.randint(0, 64, (4, 256), dtype=torch.uint8)
    codes[2, 77] = 64
    unpacked = GroupedCodes(codes, torch.rand(4, 16) + 0.1, None, 32, 8, 16)
    assert pack_grouped_codes(unpacked, 16, CPU, six_bit=True).bits == 8
    assert pack_grouped_codes(unpacked, 16, CPU).bits == 8


@pytest.mark.parametrize(("rows", "six_rows"), [(1, 0), (8, 0), (8, 4)])
def test_one_row_takes_the_integer_dot_gemv(device, rows: int, six_rows: int, monkeypatch) -> None:
    """bf16 and fp16 rows with a bias against float64, within 16-bit tolerance; float32 outputs within the bound
    of the activations' rounding (each within 2**-16 of its 32-column slot's largest)."""
    calls = []
    monkeypatch.setattr(launchers, "dot_gemv", lambda *a, _real=launchers.dot_gemv: calls.append(1) or _real(*a))
    gen = torch.Generator().manual_seed(fresh_seed())
    weights = _weights(device, fresh_seed())
    tiles = _tiles(device, rows, six_rows)
    for what, weight, order in weights:
        n, k = weight.shape
        for dtype in (torch.bfloat16, torch.float16):
            x = (torch.randn(1, k, generator=gen) * torch.logspace(-3, 1, k)[torch.randperm(k, generator=gen)]).to(dtype)
            bias = torch.randn(n, generator=gen).to(dtype)
            want = _reference(x, weight, order)
            got = grouped_int_linear(x.to(device), weight, bias.to(device), tiles)
            assert got.dtype == dtype and got.shape == (1, n)
            problem = compare(got, want + bias.double(), get_tolerance(dtype), f"{what} {dtype} rows={rows}")
            assert not problem, problem
            exact = grouped_int_linear(x.to(device), weight, None, tiles, torch.float32).double().cpu()
            bound = 2.0**-14 * float(x.abs().max()) * float(dequantize_packed(weight).abs().sum(1).max())
            assert float((exact - want).abs().max()) <= bound, what
    assert len(calls) == 2 * 2 * len(weights)


def test_group_parameters_read_after_the_wait_give_the_same_bits(device) -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    late = dataclasses.replace(_tiles(device, 8), dot_gemv_early_params=False)
    for what, weight, _ in _weights(device, fresh_seed()):
        x = (torch.randn(1, weight.shape[1], generator=gen) * 3).to(torch.bfloat16).to(device)
        assert torch.equal(grouped_int_linear(x, weight, None, late), grouped_int_linear(x, weight, None, _tiles(device, 8))), what


def test_other_rows_take_the_gemm_or_the_dequantized_copy(device, monkeypatch) -> None:
    """A float32 row, 3 and 17 rows on the grouped GEMM, 130 on the dense copy (the same values as the 8-bit
    packing's copy, bit for bit)."""
    calls = []
    monkeypatch.setattr(launchers, "dot_gemv", lambda *a, _real=launchers.dot_gemv: calls.append(1) or _real(*a))
    gen = torch.Generator().manual_seed(fresh_seed())
    tiles = _tiles(device, 8)
    picked = [w for w in _weights(device, fresh_seed()) if w[0] in ("q6_k k=512", "q6_k k=2048", "gguf_q5_k")
              or "zs=True perm=True" in w[0]]  # fmt: skip
    assert len(picked) == 4
    for what, weight, order in picked:
        n, k = weight.shape
        for m, dtype in ((1, torch.float32), (3, torch.float16), (17, torch.float16), (130, torch.float16)):
            x = torch.randn(m, k, generator=gen).to(dtype)
            got = grouped_int_linear(x.to(device), weight, None, tiles)
            problem = compare(got, _reference(x, weight, order), get_tolerance(dtype, quantized=True), f"{what} m={m}")
            assert not problem, problem
    assert not calls
    weight = make_quantized_weight("gguf_q6_k", 6, 512, seed=fresh_seed())
    x = torch.randn(130, 512, generator=gen).half().to(device)
    eight = pack_grouped_int(weight, 16, device)
    six = pack_grouped_int(weight, 16, device, six_bit=True)
    assert torch.equal(grouped_int_linear(x, six, None, tiles), grouped_int_linear(x, eight, None, tiles))


def test_gated_six_bit_gemv_fuses_the_activation(device) -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    features, k = 7, 512
    weight, _ = _q6_k(2 * features, k, device, fresh_seed())
    x = torch.randn(1, k, generator=gen).half()
    for six_rows in (0, 4):
        got = grouped_int_gated_linear(x.to(device), weight, SILU, _tiles(device, 8, six_rows))
        assert got is not None and got.shape == (1, features)
        y = _reference(x, weight, None)
        gate, up = y[:, :features], y[:, features:]
        problem = compare(got, gate * torch.sigmoid(gate) * up, get_tolerance(torch.float16), "gated Q6_K")
        assert not problem, problem


def _pair_values(pairs: np.ndarray) -> np.ndarray:
    """int16 pairs (low half first) as the activations they hold, ``[..., 2 * len]``."""
    low = (pairs & 0xFFFF).astype(np.int64)
    high = (pairs >> 16).astype(np.int64)
    both = np.stack([np.where(low >= 1 << 15, low - (1 << 16), low), np.where(high >= 1 << 15, high - (1 << 16), high)], -1)
    return both.reshape(*pairs.shape[:-1], -1)


def _bytes(words: np.ndarray) -> np.ndarray:
    return np.stack([(words >> (8 * k)) & 0xFF for k in range(4)], -1).reshape(*words.shape[:-1], -1).astype(np.int64)


def test_the_ptx_meets_its_operands() -> None:
    """The three dot products' PTX, run instruction by instruction on random registers, give the sums the kernels'
    emulation computes: 4-bit words against their low and high columns' pairs (times 16), 8-bit
    words as they are, 6-bit words with their high bits from the plane words ``A`` / ``B``, two sums."""
    rng = np.random.default_rng(fresh_seed())
    for _ in range(50):
        words = rng.integers(0, 1 << 32, 4, dtype=np.uint64)
        pairs = rng.integers(0, 1 << 32, 16, dtype=np.uint64)
        plane = rng.integers(0, 1 << 32, 2, dtype=np.uint64)
        x_low, x_high = _pair_values(pairs[:8]), _pair_values(pairs[8:])
        b = _bytes(words)
        [d4, *rest4] = run_ptx(_dot_asm(), [*map(int, words), *map(int, pairs)], 4)
        assert d4 == 16 * int((x_low * (b & 0xF)).sum() + (x_high * (b >> 4)).sum()) and rest4 == [0, 0, 0]
        [d8, *_] = run_ptx(_dot8_asm(), [*map(int, words), *map(int, pairs[:8])], 4)
        assert d8 == int((x_low * b).sum())
        # byte k of word j: column 4 j + k; its high bits at bits 2 j of byte k of A (low columns) or B (high)
        j = np.repeat(np.arange(4), 4)
        a_bits = (_bytes(plane[:1])[np.tile(np.arange(4), 4)] >> (2 * j)) & 3
        b_bits = (_bytes(plane[1:])[np.tile(np.arange(4), 4)] >> (2 * j)) & 3
        low, high, *rest6 = run_ptx(_dot6_asm(), [*map(int, words), *map(int, plane), *map(int, pairs)], 4)
        assert low == int((x_low * ((b & 0xF) | (a_bits << 4))).sum())
        assert high == int((x_high * ((b >> 4) | (b_bits << 4))).sum()) and rest6 == [0, 0]

"""GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights kept packed by the GPU backend: repacked into the grouped
integer form exactly (bit for bit in float32 against gguf's dequantizer), multiplied by the Triton GEMM and
GEMV (interpreter on the CPU), other GGUF types dequantized at load."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine_plugin_nvidia.gemm import CudaGemmBackend
from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import grouped_int_linear
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import dequantize_packed, pack_grouped_int
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import (
    INTERPRETER_GROUPED_INT_TILES,
    GroupedIntTiles,
)
from engine_plugin_sdk.grouped_codes import GGUF_GROUPED_FORMS, dequantize_codes, grouped_codes
from engine_plugin_sdk.quant import make_quantized_weight
from engine_plugin_sdk.reference_ops import ref_quantized_linear
from engine_plugin_sdk.tolerances import compare, get_tolerance

#: scheme -> (bits, group, zero point or None for zero scales, scale dtype after packing in one level)
EXPECTED = {
    "gguf_q4_0": (4, 32, 8, torch.float16),
    "gguf_q4_1": (4, 32, None, torch.float16),
    "gguf_q8_0": (8, 32, 128, torch.float16),
    "gguf_q4_k": (4, 32, None, torch.float32),
    "gguf_q6_k": (8, 16, 32, torch.float32),
    "gguf_q5_0": (8, 32, 16, torch.float16),
    "gguf_q5_1": (8, 32, None, torch.float16),
    "gguf_q5_k": (8, 32, None, torch.float32),
    "gguf_q3_k": (8, 16, 4, torch.float32),
    "gguf_q2_k": (8, 16, None, torch.float32),
    "gguf_iq4_nl": (8, 32, 128, torch.float16),
    "gguf_iq4_xs": (8, 32, 128, torch.float32),
}
#: the K-quants in two levels: (groups per super-block, the per-group integers' dtype)
TWO_LEVEL = {
    "gguf_q4_k": (8, torch.uint8), "gguf_q5_k": (8, torch.uint8), "gguf_q6_k": (16, torch.int8),
    "gguf_q3_k": (16, torch.int8), "gguf_q2_k": (16, torch.uint8), "gguf_iq4_xs": (8, torch.int8),
}  # fmt: skip
#: 2-, 3-, 5- and 6-bit codes in 8-bit storage
NARROW = {"gguf_q5_0": 5, "gguf_q5_1": 5, "gguf_q5_k": 5, "gguf_q6_k": 6, "gguf_q3_k": 3, "gguf_q2_k": 2}


def fresh_seed() -> int:
    return int(torch.randint(0, 1 << 30, ()))


@pytest.mark.parametrize("scheme", sorted(GGUF_GROUPED_FORMS))
def test_repacked_gguf_dequantizes_to_the_same_bits(scheme: str) -> None:
    weight = make_quantized_weight(scheme, 24, 512, seed=fresh_seed())
    reference = weight.dequantize()
    codes = grouped_codes(weight, torch.device("cpu"))
    bits, group, zero_point, scale_dtype = EXPECTED[scheme]
    assert (codes.bits, codes.group_size) == (bits, group) == GGUF_GROUPED_FORMS[scheme]
    assert codes.codes.dtype == torch.uint8 and int(codes.codes.max()) < 2 ** NARROW.get(scheme, bits)
    assert (codes.zero_scales is None) == (zero_point is not None)
    if zero_point is not None:
        assert codes.zero_point == zero_point
    assert torch.equal(dequantize_codes(codes), reference)
    for block_k in {group, 16 if bits == 8 else 32}:
        one_level = pack_grouped_int(weight, block_k, torch.device("cpu"), two_level=False)
        assert one_level.scales.dtype == scale_dtype and one_level.zero_point == codes.zero_point
        assert one_level.sub_groups == 0 and torch.equal(dequantize_packed(one_level), reference)
        packed = pack_grouped_int(weight, block_k, torch.device("cpu"))
        assert torch.equal(dequantize_packed(packed), reference)
        if scheme in TWO_LEVEL:
            # a small integer a group, an fp16 a super-block: exact, a quarter of the bytes or less
            assert (packed.sub_groups, packed.scales.dtype) == TWO_LEVEL[scheme]
            assert packed.super_scales.dtype == torch.float16
            assert (packed.zero_scales is None) == (packed.super_zero_scales is None) == (zero_point is not None)
            assert packed.nbytes - packed.codes.nbytes <= (one_level.nbytes - one_level.codes.nbytes) // 3
        else:
            assert packed.sub_groups == 0 and packed.scales.dtype == scale_dtype


def test_q4_1_zero_scales_are_the_negated_minimum() -> None:
    weight = make_quantized_weight("gguf_q4_1", 4, 64, seed=fresh_seed())
    blocks = weight.data.reshape(-1, 20)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float().reshape(4, 2)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float().reshape(4, 2)
    codes = grouped_codes(weight, torch.device("cpu"))
    assert torch.equal(codes.scales, d) and torch.equal(codes.zero_scales, -m)


def test_extreme_q6_k_and_q8_0_codes_stay_exact() -> None:
    """Every 6-bit / int8 value at the ends of its range, with the largest fp16 scales the formats hold."""
    q6 = make_quantized_weight("gguf_q6_k", 2, 256, seed=1)
    q6.data[:, :192] = 0xFF  # every q = 63
    q6.data[:, 192:208] = torch.tensor([-128], dtype=torch.int8).view(torch.uint8)
    q8 = make_quantized_weight("gguf_q8_0", 2, 64, seed=2)
    q8.data.reshape(-1, 34)[:, 2:] = torch.tensor([-128, 127], dtype=torch.int8).repeat(16).view(torch.uint8)
    for weight in (q6, q8):
        blocks = weight.data.reshape(weight.shape[0], -1)
        step = blocks.shape[1] // (weight.shape[1] // (256 if weight is q6 else 32))
        at = 208 if weight is q6 else 0
        for b in range(0, blocks.shape[1], step):
            blocks[:, b + at : b + at + 2] = torch.tensor([60000.0], dtype=torch.float16).view(torch.uint8)
        assert torch.equal(dequantize_packed(pack_grouped_int(weight, 16, torch.device("cpu"))), weight.dequantize())


def test_backend_keeps_the_twelve_types_packed_and_dequantizes_the_others(device) -> None:
    gemm = CudaGemmBackend(device)
    gemm.triton_grouped_int, gemm.grouped_int_tiles = True, INTERPRETER_GROUPED_INT_TILES
    assert set(GGUF_GROUPED_FORMS) <= gemm.supported_quant_schemes
    assert "gguf_tq1_0" not in gemm.supported_quant_schemes
    gen = torch.Generator().manual_seed(fresh_seed())
    eight_bit = dataclasses.replace(INTERPRETER_GROUPED_INT_TILES, six_bit_codes=False)
    for scheme in GGUF_GROUPED_FORMS:
        weight = make_quantized_weight(scheme, 40, 256, seed=fresh_seed())
        for tiles in (INTERPRETER_GROUPED_INT_TILES, eight_bit):
            gemm.grouped_int_tiles = tiles
            prepared = gemm.prepare_weight(weight, torch.float32)
            # Q2_K / Q3_K / Q5 / Q6_K codes in 6 bits where the tiles keep codes that fit so (six_bit_codes)
            bits = 6 if scheme in NARROW and tiles.six_bit_codes else EXPECTED[scheme][0]
            assert isinstance(prepared, GroupedIntWeight) and prepared.bits == bits
            for rows in (1, 3):
                x = torch.randn(rows, 256, generator=gen)
                tol = get_tolerance(torch.float32, quantized=True)
                got = gemm.linear(x.to(device), prepared)
                problem = compare(got, ref_quantized_linear(x, weight), tol, f"{scheme} M={rows} bits={bits}")
                assert not problem, problem
    other = make_quantized_weight("gguf_tq1_0", 8, 256, seed=3)
    prepared = gemm.prepare_weight(other, torch.float32)
    assert isinstance(prepared, torch.Tensor) and torch.equal(prepared.cpu(), other.dequantize())


def test_packed_gguf_bytes_against_the_file() -> None:
    """What packing costs in memory: float16 scales where exact keep Q4_0 / Q8_0 at their GGUF size; the K-quants'
    two-level scales keep Q4_K within 3% of it (a byte a group for its 6-bit scale and min, an fp16 pair a
    super-block; one level: float32 pairs, 4/3 of the file); 5- and 6-bit codes take a byte each, or 6 bits with
    ``six_bit`` (Q6_K: its file's size)."""
    out, width = 64, 1024
    for scheme, ratio, two_level, six_bit in (
        ("gguf_q4_0", 1.0, True, False), ("gguf_q8_0", 1.0, True, False), ("gguf_q4_1", 1.0, True, False),
        ("gguf_q4_k", (0.5 + 2 / 32 + 4 / 256) / (144 / 256), True, False), ("gguf_q4_k", 4 / 3, False, False),
        ("gguf_q6_k", (1 + 1 / 16 + 2 / 256) / (210 / 256), True, False), ("gguf_q6_k", 1.0, True, True),
        ("gguf_q5_0", 34 / 22, True, False), ("gguf_q5_0", 26 / 22, True, True), ("gguf_q5_1", 28 / 24, True, True),
        ("gguf_q5_k", (1 + 2 / 32 + 4 / 256) / (176 / 256), True, False),
        ("gguf_q5_k", (0.75 + 2 / 32 + 4 / 256) / (176 / 256), True, True),
        ("gguf_q3_k", (1 + 1 / 16 + 2 / 256) / (110 / 256), True, False),
        ("gguf_q3_k", (0.75 + 1 / 16 + 2 / 256) / (110 / 256), True, True),
        ("gguf_q2_k", (1 + 2 / 16 + 4 / 256) / (84 / 256), True, False),
        ("gguf_q2_k", (0.75 + 2 / 16 + 4 / 256) / (84 / 256), True, True),
        ("gguf_iq4_nl", 34 / 18, True, False), ("gguf_iq4_xs", (1 + 1 / 32 + 2 / 256) / (136 / 256), True, False),
    ):  # fmt: skip
        weight = make_quantized_weight(scheme, out, width, seed=4)
        packed = pack_grouped_int(weight, 16 if scheme in NARROW else 32, torch.device("cpu"), two_level, six_bit)
        file_bytes = weight.data.numel()
        assert packed.nbytes == pytest.approx(file_bytes * ratio, rel=0.02), (scheme, six_bit)


def test_gemv_and_gemm_read_gguf_in_float16(device) -> None:
    tiles = GroupedIntTiles(block_k=128, fp32_block_k=128, gemm=((0, 16, 64, 4, 1),), max_split_k=1,
                            gemv=INTERPRETER_GROUPED_INT_TILES.gemv,
                            gemv4=INTERPRETER_GROUPED_INT_TILES.gemv4)  # fmt: skip
    gemm = CudaGemmBackend(device)
    gemm.triton_grouped_int, gemm.grouped_int_tiles = True, tiles
    gen = torch.Generator().manual_seed(fresh_seed())
    for scheme in ("gguf_q4_k", "gguf_q6_k"):
        weight = make_quantized_weight(scheme, 48, 512, seed=fresh_seed())
        prepared = gemm.prepare_weight(weight, torch.float16)
        for rows in (1, 17):
            x = torch.randn(rows, 512, generator=gen).half()
            got = gemm.linear(x.to(device), prepared)
            problem = compare(got, ref_quantized_linear(x, weight), get_tolerance(torch.float16, quantized=True), scheme)
            assert not problem, problem
    assert np.isfinite(got.float().cpu().numpy()).all()


def test_two_level_scales_give_the_same_bits_through_every_kernel(device) -> None:
    """Q4_K, Q5_K and Q6_K with their two-level scales (a small integer a group times an fp16 a super-block, multiplied
    in float32) give exactly what their expanded float32 scales give, through each kernel that reads them: one row
    on the integer-dot GEMV (its first scales read before or after the PDL wait) and the byte GEMVs (unrolled and wide), 4 rows on the fragment kernel (Q4_K) or the
    GEMM, 17 on the GEMM, 130 on the dequantized copy; and the float64 product within fp16's tolerance."""
    base = dataclasses.replace(INTERPRETER_GROUPED_INT_TILES, mma_asm=device.type != "cpu")
    paths = {
        1: [base, dataclasses.replace(base, dot_gemv_early_params=False, dot_gemv_prefetch_params=True),
            dataclasses.replace(base, dot_gemv_rows=0), dataclasses.replace(base, dot_gemv_rows=0, gemv=(4, 64, 4, 1))],
        4: [base], 17: [base], 130: [base],
    }  # fmt: skip
    gen = torch.Generator().manual_seed(fresh_seed())
    for scheme in ("gguf_q4_k", "gguf_q5_k", "gguf_q6_k", "gguf_q3_k", "gguf_q2_k", "gguf_iq4_xs"):
        weight = make_quantized_weight(scheme, 20, 512, seed=fresh_seed())
        block = 16 if scheme in NARROW else 32
        two = pack_grouped_int(weight, block, device)
        one = pack_grouped_int(weight, block, device, two_level=False)
        assert two.sub_groups and not one.sub_groups
        bias = torch.randn(20, generator=gen).half().to(device)
        for rows, variants in paths.items():
            x = torch.randn(rows, 512, generator=gen).half().to(device)
            for tiles in variants:
                got = grouped_int_linear(x, two, bias, tiles)
                assert torch.equal(got, grouped_int_linear(x, one, bias, tiles)), (scheme, rows, tiles.dot_gemv_rows)
                want = ref_quantized_linear(x.cpu(), weight) + bias.cpu().float()
                problem = compare(got, want, get_tolerance(torch.float16, quantized=True), f"{scheme} rows={rows}")
                assert not problem, problem

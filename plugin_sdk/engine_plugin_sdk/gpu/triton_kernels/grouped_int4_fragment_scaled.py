"""The fragment kernel's chunk for 4-bit codes packed in blocks narrower than 128 columns (GGUF's Q4_0 / Q4_1 /
Q4_K blocks of 32, GPTQ's groups of 32 or 64): each lane's 16 bytes lie in one block, but an ``mma``'s four
lanes ``t`` span up to four blocks, so a block's scale cannot come off the ``mma``'s sums as it does for wide
blocks (:mod:`.grouped_int4_fragment_mma`). Here the codes become their weights in the operands instead:
``(code - zero) * scale - zero_scale`` in the 16-bit type, one exact fused subtraction and one fused
multiply-add a register pair (the scale and the zero scale rounded to the 16-bit type first, the product
rounded once), as a bf16 / fp16 copy of the dequantized weight would hold them within a rounding.

For Triton's interpreter (``ASM`` off) the same operands are computed lane by lane with the GPU's
round-to-nearest (the interpreter's own cast to bf16 truncates) and summed as the ``mma`` would.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.grouped_int4_fragment_mma import (
    _halves,
    _mma_emulated,
    _operand_lines,
    _slot_activations,
    _slot_codes,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_params import group_params_masked


def _scaled_fragment_asm(float_bits: int, ones: int, kind: str) -> str:
    """PTX for one lane's 128-column chunk: ``$0..$3`` the ``mma`` accumulators of the scaled weights times
    ``x``; inputs ``$4..$7`` words of row ``g``, ``$8..$11`` of row ``g + 8``, ``$12..$19`` and ``$20..$27`` the
    low and high columns' activation pairs, ``$28`` / ``$29`` the scale pairs of rows ``g`` / ``g + 8``, ``$30`` /
    ``$31`` their negated zero-scale pairs, ``$32`` ``-(BASE + zero)`` twice (``$33..$35`` unread)."""
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    lines = [".reg .b32 a0, a1, a2, a3, b0, b1, w, v, one;", f"mov.b32 one, {ones:#010x};"]
    lines += [f"mov.b32 ${i}, 0;" for i in range(4)]
    for u in range(4):
        for shift, select in ((0, "0x5410"), (8, "0x7632")):
            for reg, operand in _operand_lines(4, 8, u, shift, float_bits):
                lines += operand
                scale, zero = ("$28", "$30") if reg in ("a0", "a2") else ("$29", "$31")
                # BASE + code - (BASE + zero) is exact; then one rounding of (code - zero) * scale - zero scale
                lines.append(f"fma.rn.{kind}x2 {reg}, {reg}, one, $32;")
                lines.append(f"fma.rn.{kind}x2 {reg}, {reg}, {scale}, {zero};")
            lines.append(f"prmt.b32 b0, ${12 + 2 * u}, ${13 + 2 * u}, {select};")
            lines.append(f"prmt.b32 b1, ${20 + 2 * u}, ${21 + 2 * u}, {select};")
            lines.append(f"{mma} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{b0, b1}}, {{$0, $1, $2, $3}};")
    return "{\n" + "\n".join(lines) + "\n}"


_SCALED_ASM_BF16 = tl.constexpr(_scaled_fragment_asm(0x43004300, 0x3F803F80, "bf16"))
_SCALED_ASM_FP16 = tl.constexpr(_scaled_fragment_asm(0x64006400, 0x3C003C00, "f16"))
#: four float32 outputs, 32 int32 inputs (four registers of each of eight tensors)
_SCALED_CONSTRAINTS = tl.constexpr("=r," * 4 + ",".join(["r"] * 32))


@triton.jit
def _bits16(values, FP16: tl.constexpr):
    """int32 holding the 16-bit float nearest float32 ``values`` (ties to even) in its low half; bf16 by integer
    ops, as the interpreter's cast to bf16 truncates where the GPU rounds."""
    if FP16:
        bits = values.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        raw = values.to(tl.int32, bitcast=True)
        bits = ((raw + 0x7FFF + ((raw >> 16) & 1)) >> 16) & 0xFFFF
    return bits


@triton.jit
def _rounded16(values, FP16: tl.constexpr):
    """float32 of the 16-bit float nearest ``values`` (:func:`_bits16`)."""
    if FP16:
        rounded = values.to(tl.float16).to(tl.float32)
    else:
        rounded = (_bits16(values, FP16) << 16).to(tl.float32, bitcast=True)
    return rounded


@triton.jit
def _lane_params(scale_ptr, zs_ptr, super_ptr, zsuper_ptr, row_g, row_h, stride_sn, group, ok, HAS_ZS: tl.constexpr,
                 FP16: tl.constexpr, SUB_GROUPS: tl.constexpr):  # fmt: skip
    """int32 ``[LANES, 4]``: the 16-bit pairs of the scales of rows ``g`` and ``g + 8`` in each lane's ``group``
    ``[LANES]``, then of their negated zero scales (zeros where not ``ok``: such a chunk adds nothing;
    :mod:`.grouped_int_params`)."""
    s_g = group_params_masked(scale_ptr, super_ptr, row_g * stride_sn + group, ok, SUB_GROUPS)
    s_h = group_params_masked(scale_ptr, super_ptr, row_h * stride_sn + group, ok, SUB_GROUPS)
    z_g = 0.0 * s_g
    z_h = z_g
    if HAS_ZS:
        z_g = -group_params_masked(zs_ptr, zsuper_ptr, row_g * stride_sn + group, ok, SUB_GROUPS)
        z_h = -group_params_masked(zs_ptr, zsuper_ptr, row_h * stride_sn + group, ok, SUB_GROUPS)
    j = tl.arange(0, 4)[None, :]
    values = tl.where(j == 0, s_g[:, None], tl.where(j == 1, s_h[:, None], tl.where(j == 2, z_g[:, None], z_h[:, None])))
    bits = _bits16(values, FP16)
    return bits | (bits << 16)


@triton.jit
def _column(values, k: tl.constexpr):
    """Column ``k`` ``[LANES]`` of ``values [LANES, 4]``."""
    return tl.sum(tl.where(tl.arange(0, 4)[None, :] == k, values, 0.0), axis=1)


@triton.jit
def _scaled_chunk_products(wg, wh, xl0, xl1, xh0, xh1, params, WARPS: tl.constexpr, ZERO: tl.constexpr,
                           SUB_BITS: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """A chunk's ``mma`` accumulators ``[LANES, 4]`` of ``((code - ZERO) * scale - zero_scale) * x`` (``params``:
    :func:`_lane_params`; ``SUB_BITS``: ``-(BASE + ZERO)`` twice over in the 16-bit type)."""
    if ASM:
        offset = SUB_BITS + 0 * params
        if FP16:
            c = tl.inline_asm_elementwise(
                asm=_SCALED_ASM_FP16, constraints=_SCALED_CONSTRAINTS,
                args=[wg, wh, xl0, xl1, xh0, xh1, params, offset], dtype=tl.float32, is_pure=True, pack=4,
            )  # fmt: skip
        else:
            c = tl.inline_asm_elementwise(
                asm=_SCALED_ASM_BF16, constraints=_SCALED_CONSTRAINTS,
                args=[wg, wh, xl0, xl1, xh0, xh1, params, offset], dtype=tl.float32, is_pure=True, pack=4,
            )  # fmt: skip
    else:
        lo, _ = _halves(params, FP16)
        acts = _slot_activations(xl0, xl1, xh0, xh1, FP16)
        a_g = (_slot_codes(wg) - ZERO).to(tl.float32) * _column(lo, 0)[:, None, None] + _column(lo, 2)[:, None, None]
        a_h = (_slot_codes(wh) - ZERO).to(tl.float32) * _column(lo, 1)[:, None, None] + _column(lo, 3)[:, None, None]
        c, _ = _mma_emulated(_rounded16(a_g, FP16), _rounded16(a_h, FP16), acts, WARPS)
    return c


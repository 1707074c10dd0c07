"""What one 128-column chunk of 4-bit codes costs the fragment kernel (:mod:`.grouped_int4_fragment_kernels`):
the inline PTX that turns a lane's words of codes into ``mma.m16n8k16`` operands and runs the chunk's products
and activation sums, and, for Triton's interpreter (which cannot run PTX), the same products computed lane by
lane from the same registers, which checks the slot mapping.

Lane ``l = 4 g + t`` holds weight rows ``g`` and ``g + 8`` at reduction slots ``2t, 2t + 1, 2t + 8, 2t + 9``
and activation row ``g`` at the same slots; from each word it takes bytes 0 and 2 (then 1 and 3) as one slot
pair, one AND-OR making the bf16 ``128 + code`` (fp16 ``1024 + code``) of a nibble pair.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _operand_lines(word_g: int, word_h: int, u: int, shift: int, float_bits: int) -> list[tuple[str, list[str]]]:
    """The PTX filling each ``mma`` operand register ``a0..a3`` from word ``u`` of rows ``g`` (``$word_g + u``) and
    ``g + 8`` (``$word_h + u``): bytes 0 and 2 (``shift`` 0) or 1 and 3 (``shift`` 8), low nibbles (``a0``,
    ``a1``) then high ones, one AND-OR a nibble pair making the 16-bit ``BASE + code``; ``w`` / ``v`` scratch."""
    operands = []
    for reg, src, extra in (("a0", word_g, 0), ("a1", word_h, 0), ("a2", word_g, 4), ("a3", word_h, 4)):
        if shift + extra:
            tmp = "w" if src == word_g else "v"
            lines = [f"shr.b32 {tmp}, ${src + u}, {shift + extra};",
                     f"lop3.b32 {reg}, {tmp}, 0x000F000F, {float_bits:#010x}, 0xEA;"]  # fmt: skip
        else:
            lines = [f"lop3.b32 {reg}, ${src + u}, 0x000F000F, {float_bits:#010x}, 0xEA;"]
        operands.append((reg, lines))
    return operands


def _fragment_asm(float_bits: int, ones: int, kind: str) -> str:
    """PTX for one lane's 128-column chunk: ``$0..$3`` the ``mma`` accumulators of ``(128 + code) * x``,
    ``$4..$7`` those of the activations' sums; inputs ``$8..$11`` words of row ``g``, ``$12..$15`` of row ``g + 8``,
    ``$16..$23`` bf16 pairs of the low columns, ``$24..$31`` of the high ones."""
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    lines = [".reg .b32 a0, a1, a2, a3, b0, b1, w, v, one;", f"mov.b32 one, {ones:#010x};"]
    lines += [f"mov.b32 ${i}, 0;" for i in range(8)]
    for u in range(4):
        for shift, select in ((0, "0x5410"), (8, "0x7632")):
            # low nibbles pair with the low columns' activations
            for _, operand in _operand_lines(8, 12, u, shift, float_bits):
                lines += operand
            lines.append(f"prmt.b32 b0, ${16 + 2 * u}, ${17 + 2 * u}, {select};")
            lines.append(f"prmt.b32 b1, ${24 + 2 * u}, ${25 + 2 * u}, {select};")
            lines.append(f"{mma} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{b0, b1}}, {{$0, $1, $2, $3}};")
            lines.append(f"{mma} {{$4, $5, $6, $7}}, {{one, one, one, one}}, {{b0, b1}}, {{$4, $5, $6, $7}};")
    return "{\n" + "\n".join(lines) + "\n}"


_ASM_BF16 = tl.constexpr(_fragment_asm(0x43004300, 0x3F803F80, "bf16"))
_ASM_FP16 = tl.constexpr(_fragment_asm(0x64006400, 0x3C003C00, "f16"))
#: eight float32 outputs, 24 int32 inputs (four registers of each of six tensors)
_CONSTRAINTS = tl.constexpr("=r," * 8 + ",".join(["r"] * 24))


@triton.jit
def _halves(pairs, FP16: tl.constexpr):
    """float32 of the low and high 16-bit floats of int32 ``pairs``."""
    if FP16:
        lo = (pairs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((pairs >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = (pairs << 16).to(tl.float32, bitcast=True)
        hi = (pairs & -65536).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _slot_codes(words):
    """The codes ``[LANES, 4, 8]`` a lane's words ``[LANES, 4]`` put in its ``mma`` slots: per word, the first
    ``mma``'s (bytes 0 and 2, low then high nibbles) then the second's (bytes 1 and 3)."""
    shifts = tl.arange(0, 8)
    nib = tl.where(shifts < 4, 0, 8) + tl.where(shifts % 2 == 1, 16, 0) + tl.where(shifts % 4 >= 2, 4, 0)
    return (words[:, :, None] >> nib[None, None, :]) & 0xF


@triton.jit
def _slot_activations(xl0, xl1, xh0, xh1, FP16: tl.constexpr):
    """The float32 activations ``[LANES, 4, 8]`` of the same slots: word ``u``'s low-column pairs are registers
    ``2u, 2u + 1`` of ``xl0 | xl1`` (``x[c], x[c+1]``), (``x[c+2], x[c+3]``); slot order ``x[c], x[c+2], x[h],
    x[h+2], x[c+1], x[c+3], x[h+1], x[h+3]`` with ``h`` the high columns."""
    LANES: tl.constexpr = xl0.shape[0]
    l0a, l0b = _halves(xl0, FP16)
    l1a, l1b = _halves(xl1, FP16)
    h0a, h0b = _halves(xh0, FP16)
    h1a, h1b = _halves(xh1, FP16)
    la = tl.reshape(tl.join(l0a, l1a), (LANES, 2, 2, 2))  # [lane, u % 2, p, u // 2]
    lb = tl.reshape(tl.join(l0b, l1b), (LANES, 2, 2, 2))
    ha = tl.reshape(tl.join(h0a, h1a), (LANES, 2, 2, 2))
    hb = tl.reshape(tl.join(h0b, h1b), (LANES, 2, 2, 2))
    la = tl.reshape(tl.permute(la, (0, 3, 1, 2)), (LANES, 4, 2))  # [lane, u, p]
    lb = tl.reshape(tl.permute(lb, (0, 3, 1, 2)), (LANES, 4, 2))
    ha = tl.reshape(tl.permute(ha, (0, 3, 1, 2)), (LANES, 4, 2))
    hb = tl.reshape(tl.permute(hb, (0, 3, 1, 2)), (LANES, 4, 2))
    # slots: (la p0, la p1, ha p0, ha p1) then (lb p0, lb p1, hb p0, hb p1)
    first = tl.reshape(tl.permute(tl.join(la, ha), (0, 1, 3, 2)), (LANES, 4, 4))
    second = tl.reshape(tl.permute(tl.join(lb, hb), (0, 1, 3, 2)), (LANES, 4, 4))
    return tl.reshape(tl.permute(tl.join(first, second), (0, 1, 3, 2)), (LANES, 4, 8))


@triton.jit
def _mma_emulated(a_g, a_h, acts, WARPS: tl.constexpr):
    """What the ``mma`` instructions sum from the lanes' float32 operands ``[32 * WARPS, 4, 8]`` (slot values of
    rows ``g`` and ``g + 8``, and activations): lane ``(g, t)``'s accumulators ``(row g, n 2t)``, ``(g, 2t + 1)``,
    ``(g + 8, 2t)``, ``(g + 8, 2t + 1)`` sum the slot products of every lane ``(g, t')``'s operands with lane
    ``(n, t')``'s activations; and the same layout of the activations' sums."""
    LANES: tl.constexpr = 32 * WARPS
    b = tl.reshape(acts, (WARPS, 1, 8, 128))  # [warp, n, t' and slots]
    d_g = tl.sum(tl.reshape(a_g, (WARPS, 8, 1, 128)) * b, axis=3)  # [warp, g, n]
    d_h = tl.sum(tl.reshape(a_h, (WARPS, 8, 1, 128)) * b, axis=3)
    s = tl.sum(b, axis=3)  # [warp, 1, n]
    # lane (g, t), register j: row g + 8 (j // 2), n = 2t + j % 2
    c = tl.join(tl.reshape(d_g, (WARPS, 8, 4, 2)), tl.reshape(d_h, (WARPS, 8, 4, 2)))
    c = tl.reshape(tl.permute(c, (0, 1, 2, 4, 3)), (LANES, 4))
    s4 = tl.broadcast_to(tl.reshape(s, (WARPS, 1, 4, 2)), (WARPS, 8, 4, 2))
    s4 = tl.reshape(tl.permute(tl.join(s4, s4), (0, 1, 2, 4, 3)), (LANES, 4))
    return c, s4


@triton.jit
def _fragment_products_emulated(wg, wh, xl0, xl1, xh0, xh1, WARPS: tl.constexpr, BASE: tl.constexpr,
                                FP16: tl.constexpr):  # fmt: skip
    """What :func:`_fragment_asm`'s instructions compute, from the same per-lane registers ``[32 * WARPS, 4]``."""
    acts = _slot_activations(xl0, xl1, xh0, xh1, FP16)
    code_g = (_slot_codes(wg) + BASE).to(tl.float32)
    code_h = (_slot_codes(wh) + BASE).to(tl.float32)
    return _mma_emulated(code_g, code_h, acts, WARPS)


@triton.jit
def _chunk_products(wg, wh, xl0, xl1, xh0, xh1, WARPS: tl.constexpr, BASE: tl.constexpr, FP16: tl.constexpr,
                    ASM: tl.constexpr):  # fmt: skip
    """A chunk's ``mma`` accumulators ``[LANES, 4]``: of ``(BASE + code) * x``, and of the activations' sums."""
    if ASM:
        if FP16:
            c, s = tl.inline_asm_elementwise(
                asm=_ASM_FP16, constraints=_CONSTRAINTS, args=[wg, wh, xl0, xl1, xh0, xh1],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=4,
            )  # fmt: skip
        else:
            c, s = tl.inline_asm_elementwise(
                asm=_ASM_BF16, constraints=_CONSTRAINTS, args=[wg, wh, xl0, xl1, xh0, xh1],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=4,
            )  # fmt: skip
    else:
        c, s = _fragment_products_emulated(wg, wh, xl0, xl1, xh0, xh1, WARPS, BASE, FP16)
    return c, s

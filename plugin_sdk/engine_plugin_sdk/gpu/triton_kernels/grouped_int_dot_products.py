"""One slot's integer dot products for the integer-dot GEMV (:mod:`.grouped_int_dot_gemv_kernels`): the words of
a slot's codes against its activations as int16 pairs, by ``dp2a`` in inline PTX (sm_61 and later), or, in the
interpreter, the same integer sums with plain integer ops.

A 4-bit slot is 32 columns: its four words hold the low nibbles of columns ``16 q .. 16 q + 15`` and the high
nibbles of ``BLOCK / 2 + 16 q ..`` (word ``j``'s byte ``k``: column ``16 q + 4 j + k``); an 8-bit slot is 16
consecutive columns, a word's byte ``k`` column ``4 j + k``. The activation pairs ``p0`` / ``p1`` hold pairs
0-3 / 4-7 of a run of 16 columns (pair ``i``: columns ``2 i`` (low half) and ``2 i + 1``).
"""

from __future__ import annotations

import triton
import triton.language as tl


def _dot_asm() -> str:
    """PTX for one slot of one row of 4-bit codes: ``$0`` the sum over its four words ``$4..$7`` of 16 x (codes .
    activations), the activations as int16 pairs: ``$8..$11`` / ``$12..$15`` the low columns' pairs 0-3 / 4-7,
    ``$16..$23`` the high columns' (``$1..$3`` are zero)."""
    lines = [".reg .b32 l, h, sl, sh;", "mov.b32 sl, 0;", "mov.b32 sh, 0;"]
    for j in range(4):
        # word j's columns 4j .. 4j+3 are pairs 2j and 2j + 1 of the slot's eight
        first, second = 8 + 2 * j, 9 + 2 * j
        lines += [
            f"and.b32 l, ${4 + j}, 0x0F0F0F0F;",
            f"and.b32 h, ${4 + j}, 0xF0F0F0F0;",
            f"dp2a.lo.s32.u32 sl, ${first}, l, sl;",
            f"dp2a.hi.s32.u32 sl, ${second}, l, sl;",
            f"dp2a.lo.s32.u32 sh, ${first + 8}, h, sh;",
            f"dp2a.hi.s32.u32 sh, ${second + 8}, h, sh;",
        ]
    lines += ["mad.lo.s32 $0, sl, 16, sh;", "mov.b32 $1, 0;", "mov.b32 $2, 0;", "mov.b32 $3, 0;"]
    return "{\n" + "\n".join(lines) + "\n}"


def _dot8_asm() -> str:
    """PTX for one slot of one row of 8-bit codes: ``$0`` the sum over its four words ``$4..$7`` (columns ``4j ..
    4j + 3``) of codes . activations, the activations' pairs 0-3 / 4-7 in ``$8..$11`` / ``$12..$15``."""
    lines = [".reg .b32 s;", "mov.b32 s, 0;"]
    for j in range(4):
        lines += [f"dp2a.lo.s32.u32 s, ${8 + 2 * j}, ${4 + j}, s;", f"dp2a.hi.s32.u32 s, ${9 + 2 * j}, ${4 + j}, s;"]
    lines += ["mov.b32 $0, s;", "mov.b32 $1, 0;", "mov.b32 $2, 0;", "mov.b32 $3, 0;"]
    return "{\n" + "\n".join(lines) + "\n}"


_DOT_ASM = tl.constexpr(_dot_asm())
_DOT8_ASM = tl.constexpr(_dot8_asm())
#: four int32 outputs, 20 int32 inputs (four registers of each of five tensors); 12 for 8-bit codes (three)
_DOT_CONSTRAINTS = tl.constexpr("=r," * 4 + ",".join(["r"] * 20))
_DOT8_CONSTRAINTS = tl.constexpr("=r," * 4 + ",".join(["r"] * 12))


@triton.jit
def _element0(t):
    """``t[..., 0]`` of a ``[R, S, 4]`` tensor (a thread's own registers)."""
    a, _ = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 2, 2)))
    first, _ = tl.split(a)
    return first


@triton.jit
def _word_pairs(p0, p1):
    """The pairs of each word ``j``: pair ``2j`` and ``2j + 1`` of the slot's eight (``p0`` holds 0-3, ``p1`` 4-7),
    as two ``[S, 4]`` tensors."""
    S: tl.constexpr = p0.shape[0]
    eight = tl.reshape(tl.permute(tl.join(p0, p1), (0, 2, 1)), (S, 8))
    return tl.split(tl.reshape(eight, (S, 4, 2)))


@triton.jit
def _dots_emulated(words, pl0, pl1, ph0, ph1):
    """What :func:`_dot_asm` computes, with plain integer ops: ``[R, S]``."""
    la, lb = _word_pairs(pl0, pl1)
    ha, hb = _word_pairs(ph0, ph1)
    w = words
    low = ((la << 16) >> 16)[None] * (w & 0xF) + (la >> 16)[None] * ((w >> 8) & 0xF)
    low += ((lb << 16) >> 16)[None] * ((w >> 16) & 0xF) + (lb >> 16)[None] * ((w >> 24) & 0xF)
    high = ((ha << 16) >> 16)[None] * ((w >> 4) & 0xF) + (ha >> 16)[None] * ((w >> 12) & 0xF)
    high += ((hb << 16) >> 16)[None] * ((w >> 20) & 0xF) + (hb >> 16)[None] * ((w >> 28) & 0xF)
    return tl.sum(16 * (low + high), axis=2)


@triton.jit
def _dots8_emulated(words, pl0, pl1):
    """What :func:`_dot8_asm` computes, with plain integer ops: ``[R, S]``."""
    la, lb = _word_pairs(pl0, pl1)
    w = words
    low = ((la << 16) >> 16)[None] * (w & 0xFF) + (la >> 16)[None] * ((w >> 8) & 0xFF)
    low += ((lb << 16) >> 16)[None] * ((w >> 16) & 0xFF) + (lb >> 16)[None] * ((w >> 24) & 0xFF)
    return tl.sum(low, axis=2)


@triton.jit
def _slot_dots(words, pl0, pl1, ph0, ph1, ASM: tl.constexpr, BITS: tl.constexpr):
    """The integer dot product of each row's slot ``[R, S]`` with the slots' int16 activations (16 times it for
    4-bit codes)."""
    if ASM and BITS == 4:
        d = tl.inline_asm_elementwise(
            asm=_DOT_ASM, constraints=_DOT_CONSTRAINTS,
            args=[words, pl0[None, :, :], pl1[None, :, :], ph0[None, :, :], ph1[None, :, :]],
            dtype=tl.int32, is_pure=True, pack=4,
        )  # fmt: skip
        return _element0(d)
    elif ASM:
        d = tl.inline_asm_elementwise(
            asm=_DOT8_ASM, constraints=_DOT8_CONSTRAINTS, args=[words, pl0[None, :, :], pl1[None, :, :]],
            dtype=tl.int32, is_pure=True, pack=4,
        )  # fmt: skip
        return _element0(d)
    elif BITS == 4:
        return _dots_emulated(words, pl0, pl1, ph0, ph1)
    return _dots8_emulated(words, pl0, pl1)

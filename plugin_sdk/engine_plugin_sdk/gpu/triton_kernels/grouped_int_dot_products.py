"""One slot's integer dot products for the integer-dot GEMV (:mod:`.grouped_int_dot_gemv_kernels`): the words of
a slot's codes against its activations as int16 pairs, by ``dp2a`` in inline PTX (sm_61 and later), or, in the
interpreter, the same integer sums with plain integer ops.

A 4-bit slot is 32 columns: its four words hold the low nibbles of columns ``16 q .. 16 q + 15`` and the high
nibbles of ``BLOCK / 2 + 16 q ..`` (word ``j``'s byte ``k``: column ``16 q + 4 j + k``); an 8-bit slot is 16
consecutive columns, a word's byte ``k`` column ``4 j + k``. The activation pairs ``p0`` / ``p1`` hold pairs
0-3 / 4-7 of a run of 16 columns (pair ``i``: columns ``2 i`` (low half) and ``2 i + 1``).

A 6-bit slot is a 4-bit one whose codes take their high two bits from the block's plane words ``A`` (the low
columns') and ``B`` (the high ones'): word ``j``'s low columns are the bytes ``(w & 0x0F0F0F0F) | (((A >> 2j) &
0x03030303) << 4)``, its high ones ``((w >> 4) & 0x0F0F0F0F) | (((B >> 2j) & 0x03030303) << 4)``, whole codes a
byte as 8-bit slots have them; the two halves' sums stay apart (a block may span two groups).
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


def _dot6_asm() -> str:
    """PTX for one slot of one row of 6-bit codes: ``$0`` / ``$1`` the low / high columns' sums of codes .
    activations, from the slot's four nibble words ``$4..$7``, its plane words ``A`` in ``$8`` and ``B`` in
    ``$9`` (its four int16 halves, packed two a register), and the activations' int16 pairs: ``$10..$17`` the low
    columns' pairs 0-7, ``$18..$25`` the high ones'."""
    lines = [".reg .b32 l, h, a, b, sl, sh;", "mov.b32 sl, 0;", "mov.b32 sh, 0;"]
    # word j's high bits sit at bits 2j of each plane byte: shifted to bits 4-5 of each byte
    shifts = {0: ("shl", 4), 1: ("shl", 2), 2: ("mov", 0), 3: ("shr", 2)}
    for j in range(4):
        op, by = shifts[j]
        for reg, plane in (("a", 8), ("b", 9)):
            lines.append(f"mov.b32 {reg}, ${plane};" if op == "mov" else f"{op}.b32 {reg}, ${plane}, {by};")
            lines.append(f"and.b32 {reg}, {reg}, 0x30303030;")
        lines += [
            f"and.b32 l, ${4 + j}, 0x0F0F0F0F;",
            "or.b32 l, l, a;",
            f"shr.b32 h, ${4 + j}, 4;",
            "and.b32 h, h, 0x0F0F0F0F;",
            "or.b32 h, h, b;",
            f"dp2a.lo.s32.u32 sl, ${10 + 2 * j}, l, sl;",
            f"dp2a.hi.s32.u32 sl, ${11 + 2 * j}, l, sl;",
            f"dp2a.lo.s32.u32 sh, ${18 + 2 * j}, h, sh;",
            f"dp2a.hi.s32.u32 sh, ${19 + 2 * j}, h, sh;",
        ]
    lines += ["mov.b32 $0, sl;", "mov.b32 $1, sh;", "mov.b32 $2, 0;", "mov.b32 $3, 0;"]
    return "{\n" + "\n".join(lines) + "\n}"


_DOT_ASM = tl.constexpr(_dot_asm())
_DOT8_ASM = tl.constexpr(_dot8_asm())
_DOT6_ASM = tl.constexpr(_dot6_asm())
#: four int32 outputs, 20 int32 inputs (four registers of each of five tensors); 12 for 8-bit codes (three)
_DOT_CONSTRAINTS = tl.constexpr("=r," * 4 + ",".join(["r"] * 20))
_DOT8_CONSTRAINTS = tl.constexpr("=r," * 4 + ",".join(["r"] * 12))
_DOT6_CONSTRAINTS = tl.constexpr("=r," * 4 + ",".join(["r"] * 22))


@triton.jit
def _elements(t):
    """``t[..., 0]`` .. ``t[..., 3]`` of a ``[R, S, 4]`` tensor (a thread's own registers)."""
    # the halves of the split are elements 0, 2 and 1, 3
    even, odd = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 2, 2)))
    e0, e2 = tl.split(even)
    e1, e3 = tl.split(odd)
    return e0, e1, e2, e3


@triton.jit
def _element0(t):
    """``t[..., 0]`` of a ``[R, S, 4]`` tensor."""
    e0, _, _, _ = _elements(t)
    return e0


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
def _six_bit_words(words, plane):
    """What :func:`_dot6_asm` makes of a slot's nibble words and its plane (int16 halves of ``A`` then ``B``): the
    words of its low and high columns' whole codes, ``[R, S, 4]`` each."""
    shift = 2 * tl.arange(0, 4)[None, None, :]
    h0, h1, h2, h3 = _elements(plane.to(tl.int32) & 0xFFFF)
    a = (h0 | (h1 << 16))[:, :, None]
    b = (h2 | (h3 << 16))[:, :, None]
    low = (words & 0x0F0F0F0F) | (((a >> shift) & 0x03030303) << 4)
    high = ((words >> 4) & 0x0F0F0F0F) | (((b >> shift) & 0x03030303) << 4)
    return low, high


@triton.jit
def _slot_dots6(words, plane, pl0, pl1, ph0, ph1, ASM: tl.constexpr):
    """The integer dot products of each row's 6-bit slot ``[R, S]`` with its activations: the low columns' and the
    high columns' (:func:`_dot6_asm`)."""
    if ASM:
        d = tl.inline_asm_elementwise(
            asm=_DOT6_ASM, constraints=_DOT6_CONSTRAINTS,
            args=[words, plane, pl0[None, :, :], pl1[None, :, :], ph0[None, :, :], ph1[None, :, :]],
            dtype=tl.int32, is_pure=True, pack=4,
        )  # fmt: skip
        low, high, _, _ = _elements(d)
        return low, high
    low, high = _six_bit_words(words, plane)
    return _dots8_emulated(low, pl0, pl1), _dots8_emulated(high, ph0, ph1)


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

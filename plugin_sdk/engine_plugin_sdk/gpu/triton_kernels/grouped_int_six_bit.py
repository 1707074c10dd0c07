"""6-bit grouped codes (GGUF's Q6_K kept in 6 bits, :class:`~engine_plugin_sdk.gpu.gemm.GroupedIntWeight`) in the
tiled kernels: their low nibbles sit in the 4-bit layout over blocks of 32 columns, so a tile of code bytes splits
into its low and high halves as 4-bit codes do, and each half takes its high two bits from the plane beside.

Why 6 bits: Q4_K_M keeps the LM head, ``attn_v`` and about half of ``ffn_down`` in Q6_K, 1.5 GB of a Llama-3-8B
step as a byte a code; in 6 bits a batch-1 step reads 0.38 GB less (the file's own size: 6.56 bits a weight with
the two-level scales).

A block's halves may lie in two groups (Q6_K's groups are 16 columns): each half takes its own group's scales.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: columns of a block; its plane holds 8 bytes
SIX_BLOCK = tl.constexpr(32)


@triton.jit
def six_bit_halves(codes, plane_rows, p_col0, mask):
    """int32 codes of a tile's low and high halves ``[N, C]`` from its nibble bytes ``codes [N, C]`` (whole blocks:
    byte ``c`` is byte ``c % 16`` of the tile's ``c // 16``-th block), whose planes are the ``C / 2`` bytes from byte
    ``p_col0`` of ``plane_rows`` (``[N, 1]`` row pointers; ``mask`` their rows')."""
    N: tl.constexpr = codes.shape[0]
    C: tl.constexpr = codes.shape[1]
    BLOCKS: tl.constexpr = C // 16
    # the planes as one contiguous run a row (a vector load, pipelined with the codes'), then spread over the
    # bytes: byte r of a block takes bits 2 (r // 4) of its plane bytes r % 4 (low half) and 4 + r % 4 (high)
    plane = tl.load(plane_rows + (p_col0 + tl.arange(0, C // 2))[None, :], mask=mask, other=0).to(tl.int32)
    a, b = tl.split(tl.permute(tl.reshape(plane, (N, BLOCKS, 2, 4)), (0, 1, 3, 2)))
    shift = (2 * tl.arange(0, 4))[None, None, :, None]
    a = tl.reshape((a[:, :, None, :] >> shift) & 0x3, (N, C))
    b = tl.reshape((b[:, :, None, :] >> shift) & 0x3, (N, C))
    wide = codes.to(tl.int32)
    return (wide & 0xF) | (a << 4), (wide >> 4) | (b << 4)


@triton.jit
def six_bit_plane_words(p16, rows, stride_p, s0, S: tl.constexpr, NUM_SLOTS: tl.constexpr, EVEN: tl.constexpr):
    """The rows' plane bytes of blocks ``s0 ..`` as int16 ``[R, S, 4]`` (``p16``: the plane as int16, ``stride_p``
    its rows' stride in them): a thread holds its block's four, the layout of its code words, and an inline-asm
    call with ``pack=4`` takes them as two 32-bit registers, ``A`` and ``B``."""
    R: tl.constexpr = rows.shape[0]
    flat = 4 * s0 + tl.arange(0, 4 * S)
    # four halves (8 bytes) a thread: at most 8-byte runs, so that no thread's load spans two blocks
    at = tl.max_contiguous(tl.multiple_of(rows[:, None] * stride_p + flat[None, :], [1, 4]), [1, 4])
    if EVEN:
        halves = tl.load(p16 + at)
    else:
        halves = tl.load(p16 + at, mask=(flat < 4 * NUM_SLOTS)[None, :], other=0)
    return tl.reshape(halves, (R, S, 4))

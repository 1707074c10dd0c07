"""The single-row product over 4-bit grouped codes read as 32-bit words: ``out[n] = sum_k x[perm[k]] *
W[n, k] (+ bias[n])`` for batch-1 decode and the LM head, in the packed layout of
:mod:`.grouped_int_kernels` (byte ``r`` of a block of ``BLOCK`` columns holds column ``r`` in its low
nibble and column ``BLOCK / 2 + r`` in its high one).

At batch 1 a 4-bit product is bound by the instructions that turn codes into floats, not by memory: read as
bytes, each code cost a byte extract, a mask, a shift, the float bit trick, a subtraction, a multiply-add and
a share of the scaling (about seven instructions in the loop; an H200 streamed such codes at 1.0-1.5 TB/s).
Here each 16-bit half of a word gets the exponent bits of the float ``2**23`` once (one shift and two
logical ops a word), and then each code is one AND that keeps those bits and the code's own bits *in
place*: the float is ``2**23 + code * 2**s`` (``s`` the code's offset in its half), exact since a half fits
the 23-bit mantissa. One subtraction of ``2**23 + zero * 2**s`` gives ``(code - zero) * 2**s`` exactly, and
the activation it multiplies was scaled by ``2**-s`` once for all the program's rows (a power of two:
exact). The group scale (and zero scale) applies once a word. A code costs about four instructions.

Word ``j`` of a block holds the low nibbles of columns ``4j .. 4j+3`` and the high nibbles of columns
``BLOCK / 2 + 4j ..``: a program's words and their four byte positions form ``[SUBS, WPB, 4]`` tiles whose
activations are two contiguous runs a sub-block (vector loads), read and converted once for the program's
rows. The exponent bits come in as an argument (``float_bits``, :data:`FLOAT_2_23_BITS`): as a constant the
compiler folds each half's OR back into every code's AND, two constants a logical op.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.grouped_int_gemv_rows import _NOT_GATED, _program_rows, _store_rows
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_kernels import _high_activations, _high_nibbles
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait

#: the bits of the float 2**23 (exponent 150, zero mantissa); the launcher passes them as ``float_bits``
FLOAT_2_23_BITS = 0x4B000000
#: the bits of 1.0, ``float_bits`` of the 16-bit activations' path (``HIGH``)
FLOAT_ONE_BITS = 0x3F800000


@triton.jit
def _row_halves(w32, s_ptr, z_ptr, row, stride_w, stride_s, blocks, offs_w, float_bits, NUM_BLOCKS,
                WPB: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_ZS: tl.constexpr,
                EVEN: tl.constexpr, HIGH: tl.constexpr):  # fmt: skip
    """Row ``row``'s words of sub-blocks ``blocks`` as two halves carrying ``float_bits`` ``[SUBS, WPB, 1]``,
    and the float32 scales and zero scales ``[SUBS, 1, 1]`` of those sub-blocks."""
    # two words a thread (8-byte loads), as the activations they multiply are laid out (_step)
    ptrs = w32 + row.to(tl.int64) * stride_w + tl.max_contiguous(blocks[:, None] * WPB + offs_w[None, :], [1, 2])
    params = row.to(tl.int64) * stride_s + blocks * BLOCK // GROUP
    if EVEN:
        words = tl.load(ptrs)
        scale = tl.load(s_ptr + params).to(tl.float32)[:, None, None]
        zs = scale
        if HAS_ZS:
            zs = tl.load(z_ptr + params).to(tl.float32)[:, None, None]
    else:
        ok = blocks < NUM_BLOCKS
        words = tl.load(ptrs, mask=ok[:, None], other=0)
        scale = tl.load(s_ptr + params, mask=ok, other=0.0).to(tl.float32)[:, None, None]
        zs = scale
        if HAS_ZS:
            zs = tl.load(z_ptr + params, mask=ok, other=0.0).to(tl.float32)[:, None, None]
    if HIGH:
        # both nibbles of each byte go high in the mantissa in _codes_high: the raw words travel as they are
        return words[:, :, None], words[:, :, None], scale, zs
    low = ((words & 0xFFFF) | float_bits)[:, :, None]
    high = ((words >> 16) | float_bits)[:, :, None]
    return low, high, scale, zs


@triton.jit
def _codes(low, high, keep_lo, keep_hi, sub_lo, sub_hi, offs_q):
    """``(code - zero) * 2**s`` in float32 of the low and high nibbles of each word's bytes ``[SUBS, WPB, 4]``
    (``keep_*``: ``float_bits`` and the nibble's bits in its half; ``sub_*``: ``2**23 + zero * 2**s``)."""
    half = tl.where(offs_q < 2, low, high)
    code_lo = (half & keep_lo).to(tl.float32, bitcast=True) - sub_lo
    code_hi = (half & keep_hi).to(tl.float32, bitcast=True) - sub_hi
    return code_lo, code_hi


@triton.jit
def _codes_high(words, float_bits, offs_q):
    """``1 + code * 2**-8`` (low nibble) and ``1 + code * 2**-4`` (high nibble) in float32 of each word's bytes
    ``[SUBS, WPB, 4]``: byte ``q`` shifted to mantissa bits 15-22, then one AND-OR a nibble."""
    t = tl.where(offs_q == 0, words << 15, tl.where(offs_q == 1, words << 7, tl.where(offs_q == 2, words >> 1, words >> 9)))
    return _high_nibbles(t, float_bits)


@triton.jit
def _quarters(t):
    """The four ``[SUBS, WPB]`` byte positions of a ``[SUBS, WPB, 4]`` tile (a thread's own values)."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 2, 2)))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, a1, b0, b1


@triton.jit
def _x_of(x_ptr, perm_ptr, cols, ok, HAS_PERM: tl.constexpr, EVEN: tl.constexpr):
    """float32 activations of stored columns ``cols``: ``x[perm[cols]]``."""
    if EVEN:
        if HAS_PERM:
            cols = tl.load(perm_ptr + cols)
        return tl.load(x_ptr + cols).to(tl.float32)
    else:
        if HAS_PERM:
            cols = tl.load(perm_ptr + cols, mask=ok, other=0)
        return tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _acc(acc, low, high, scale, zs, keep_lo, keep_hi, sub_lo, sub_hi, offs_q, x_lo, x_hi, x_sum, float_bits, x_off,
         HAS_ZS: tl.constexpr, HIGH: tl.constexpr):  # fmt: skip
    if HIGH:
        # x_lo * (1 + c_lo / 256) * 256 + x_hi * (1 + c_hi / 16) * 16 - x_off = x_lo (c_lo - z) + x_hi (c_hi - z),
        # a word's four bytes as one chain of multiply-adds: one scaling a word, not one a byte
        code_lo, code_hi = _codes_high(low, float_bits, offs_q)
        l0, l1, l2, l3 = _quarters(code_lo)
        h0, h1, h2, h3 = _quarters(code_hi)
        xl0, xl1, xl2, xl3 = _quarters(x_lo)
        xh0, xh1, xh2, xh3 = _quarters(x_hi)
        d = tl.fma(h0, xh0, x_off)
        d = tl.fma(l0, xl0, d)
        d = tl.fma(h1, xh1, d)
        d = tl.fma(l1, xl1, d)
        d = tl.fma(h2, xh2, d)
        d = tl.fma(l2, xl2, d)
        d = tl.fma(h3, xh3, d)
        d = tl.fma(l3, xl3, d)[:, :, None]
    else:
        code_lo, code_hi = _codes(low, high, keep_lo, keep_hi, sub_lo, sub_hi, offs_q)
        d = code_lo * x_lo + code_hi * x_hi
    if HAS_ZS:
        return acc + d * scale - x_sum * zs
    else:
        return acc + d * scale


@triton.jit
def _step(acc0, acc1, acc2, acc3, l0, h0, s0, z0, l1, h1, s1, z1, l2, h2, s2, z2, l3, h3, s3, z3, x_ptr, perm_ptr,
          blocks, offs_w, offs_q, keep_lo, keep_hi, sub_lo, sub_hi, float_bits, NUM_BLOCKS, BLOCK: tl.constexpr,
          HAS_ZS: tl.constexpr, HAS_PERM: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr,
          OFFSET: tl.constexpr, HIGH: tl.constexpr):  # fmt: skip
    """The rows' accumulators plus one tile of words each, the activations read, converted and scaled once
    for all ``ROWS`` rows."""
    # read as [SUBS, BLOCK / 2] runs (8 activations a thread) and viewed as [SUBS, WPB, 4]: two words a
    # thread, the layout the words are read in
    WPB: tl.constexpr = BLOCK // 8
    cols = blocks[:, None] * BLOCK + tl.arange(0, BLOCK // 2)[None, :]
    ok = (blocks < NUM_BLOCKS)[:, None]
    x_lo = tl.reshape(_x_of(x_ptr, perm_ptr, cols, ok, HAS_PERM, EVEN), (blocks.shape[0], WPB, 4))
    x_hi = tl.reshape(_x_of(x_ptr, perm_ptr, cols + BLOCK // 2, ok, HAS_PERM, EVEN), (blocks.shape[0], WPB, 4))
    x_sum = x_lo
    if HAS_ZS:
        x_sum = x_lo + x_hi
        if HIGH:
            x_sum = tl.sum(x_sum, axis=2, keep_dims=True)
    x_off = x_lo
    if HIGH:
        # the codes carry 1 + code * 2**-8 (low nibble) and 1 + code * 2**-4 (high): activations times 256 and 16
        # (exact), and what the ones and the zero point add, taken off once for all the rows
        x_lo, x_hi, x_off = _high_activations(x_lo, x_hi, OFFSET)
        x_off = tl.sum(x_off, axis=2)
    else:
        # each code comes times 2**s: its activation times 2**-s (exact)
        x_lo = x_lo * tl.where(offs_q % 2 == 1, 1.0 / 256, 1.0)
        x_hi = x_hi * tl.where(offs_q % 2 == 1, 1.0 / 4096, 1.0 / 16)
    acc0 = _acc(acc0, l0, h0, s0, z0, keep_lo, keep_hi, sub_lo, sub_hi, offs_q, x_lo, x_hi, x_sum, float_bits, x_off,
                HAS_ZS, HIGH)  # fmt: skip
    if ROWS > 1:
        acc1 = _acc(acc1, l1, h1, s1, z1, keep_lo, keep_hi, sub_lo, sub_hi, offs_q, x_lo, x_hi, x_sum, float_bits,
                    x_off, HAS_ZS, HIGH)  # fmt: skip
    if ROWS > 2:
        acc2 = _acc(acc2, l2, h2, s2, z2, keep_lo, keep_hi, sub_lo, sub_hi, offs_q, x_lo, x_hi, x_sum, float_bits,
                    x_off, HAS_ZS, HIGH)  # fmt: skip
        acc3 = _acc(acc3, l3, h3, s3, z3, keep_lo, keep_hi, sub_lo, sub_hi, offs_q, x_lo, x_hi, x_sum, float_bits,
                    x_off, HAS_ZS, HIGH)  # fmt: skip
    return acc0, acc1, acc2, acc3


@triton.jit
def _tiles(w32, s_ptr, z_ptr, r0, r1, r2, r3, stride_w, stride_s, blocks, offs_w, float_bits, NUM_BLOCKS,
           WPB: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_ZS: tl.constexpr, EVEN: tl.constexpr,
           ROWS: tl.constexpr, HIGH: tl.constexpr):  # fmt: skip
    """The words of the program's ``ROWS`` rows ``r0 .. r3`` (:func:`_program_rows`)."""
    l0, h0, s0, z0 = _row_halves(w32, s_ptr, z_ptr, r0, stride_w, stride_s, blocks, offs_w, float_bits,
                                 NUM_BLOCKS, WPB, BLOCK, GROUP, HAS_ZS, EVEN, HIGH)  # fmt: skip
    l1, h1, s1, z1, l2, h2, s2, z2, l3, h3, s3, z3 = l0, h0, s0, z0, l0, h0, s0, z0, l0, h0, s0, z0
    if ROWS > 1:
        l1, h1, s1, z1 = _row_halves(w32, s_ptr, z_ptr, r1, stride_w, stride_s, blocks, offs_w, float_bits,
                                     NUM_BLOCKS, WPB, BLOCK, GROUP, HAS_ZS, EVEN, HIGH)  # fmt: skip
    if ROWS > 2:
        l2, h2, s2, z2 = _row_halves(w32, s_ptr, z_ptr, r2, stride_w, stride_s, blocks, offs_w, float_bits,
                                     NUM_BLOCKS, WPB, BLOCK, GROUP, HAS_ZS, EVEN, HIGH)  # fmt: skip
        l3, h3, s3, z3 = _row_halves(w32, s_ptr, z_ptr, r3, stride_w, stride_s, blocks, offs_w, float_bits,
                                     NUM_BLOCKS, WPB, BLOCK, GROUP, HAS_ZS, EVEN, HIGH)  # fmt: skip
    return l0, h0, s0, z0, l1, h1, s1, z1, l2, h2, s2, z2, l3, h3, s3, z3


@triton.jit
def _total(acc):
    """A row's sum of its ``[SUBS, WPB, 1 or 4]`` accumulator."""
    return tl.sum(tl.sum(tl.sum(acc, axis=2), axis=1), axis=0)


@triton.jit
def grouped_int4_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr,
    N, stride_wn, stride_sn, float_bits,
    NUM_BLOCKS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr,
    HAS_ZS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SUBS: tl.constexpr, EVEN: tl.constexpr, USE_PDL: tl.constexpr,
    HIGH: tl.constexpr = False, LOOP_STAGES: tl.constexpr = 1, GATED: tl.constexpr = -1,
):  # fmt: skip
    """``out[n] = sum_k x[perm[k]] * W[n, k] (+ bias[n])`` for ``ROWS`` (1, 2 or 4) output features ``n``; or,
    with ``GATED`` (an activation of :func:`.elementwise_kernels.gated_product`; ``ROWS`` 4, no bias),
    ``out[f] = act(gate[f]) * up[f]`` for two features ``f`` of a weight stacking the gate's rows over the up
    rows (``out``: ``N / 2`` features): the activation in the same launch.

    Arguments as :func:`~.grouped_int_kernels.grouped_int_gemv_kernel`'s for 4-bit codes, plus
    ``float_bits`` (:data:`FLOAT_2_23_BITS`, or :data:`FLOAT_ONE_BITS` with ``HIGH``). ``w_ptr`` and
    ``stride_wn`` (bytes) must be multiples of 4. ``HIGH`` (16-bit activations): each code goes to the top of
    a float's mantissa (``_codes_high``), which saves the subtraction per code; the products carry the ones
    of those floats, up to 256 times the activation, which float32 sums hold within about 2**-16 of it.
    """
    tl.static_assert(GATED == _NOT_GATED or (ROWS == 4 and not HAS_BIAS), "a gated GEMV runs 4 rows, no bias")
    r0, r1, r2, r3, first_out = _program_rows(N, ROWS, GATED)
    WPB: tl.constexpr = BLOCK // 8
    # a weight with zero scales has its zero in them
    OFFSET: tl.constexpr = 0 if HAS_ZS else ZERO
    w32 = w_ptr.to(tl.pointer_type(tl.uint32))
    stride_w = stride_wn // 4
    offs_w = tl.arange(0, WPB)
    offs_j = tl.arange(0, SUBS)
    # byte q of a word: its low nibble at bit 8 * (q % 2) of half q // 2, its high nibble 4 bits up
    offs_q = tl.arange(0, 4)[None, None, :]
    odd = offs_q % 2 == 1
    keep_lo = float_bits | tl.where(odd, 0xF00, 0xF)
    keep_hi = float_bits | tl.where(odd, 0xF000, 0xF0)
    sub_lo = 8388608.0 + OFFSET * tl.where(odd, 256.0, 1.0)
    sub_hi = 8388608.0 + OFFSET * tl.where(odd, 4096.0, 16.0)
    # the 16-bit path sums each word's four bytes before its accumulator (_acc)
    acc0 = tl.zeros((SUBS, WPB, 1 if HIGH else 4), dtype=tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    first = 0
    if USE_PDL:
        # the weight is constant: its first words are read while the kernel that writes x drains
        gdc_launch_dependents()
        l0, h0, s0, z0, l1, h1, s1, z1, l2, h2, s2, z2, l3, h3, s3, z3 = _tiles(
            w32, scale_ptr, zs_ptr, r0, r1, r2, r3, stride_w, stride_sn, offs_j, offs_w, float_bits, NUM_BLOCKS, WPB,
            BLOCK, GROUP, HAS_ZS, EVEN, ROWS, HIGH,
        )  # fmt: skip
        gdc_wait()
        acc0, acc1, acc2, acc3 = _step(
            acc0, acc1, acc2, acc3, l0, h0, s0, z0, l1, h1, s1, z1, l2, h2, s2, z2, l3, h3, s3, z3, x_ptr, perm_ptr,
            offs_j, offs_w, offs_q, keep_lo, keep_hi, sub_lo, sub_hi, float_bits, NUM_BLOCKS, BLOCK, HAS_ZS, HAS_PERM,
            EVEN, ROWS, OFFSET, HIGH,
        )  # fmt: skip
        first = SUBS
    # past the first tile, Triton's pipeliner reads LOOP_STAGES - 1 iterations' tiles ahead (cp.async through
    # shared memory); a plain loop waits for each iteration's tiles
    for b0 in tl.range(first, NUM_BLOCKS, SUBS, num_stages=LOOP_STAGES):
        blocks = b0 + offs_j
        l0, h0, s0, z0, l1, h1, s1, z1, l2, h2, s2, z2, l3, h3, s3, z3 = _tiles(
            w32, scale_ptr, zs_ptr, r0, r1, r2, r3, stride_w, stride_sn, blocks, offs_w, float_bits, NUM_BLOCKS, WPB,
            BLOCK, GROUP, HAS_ZS, EVEN, ROWS, HIGH,
        )  # fmt: skip
        acc0, acc1, acc2, acc3 = _step(
            acc0, acc1, acc2, acc3, l0, h0, s0, z0, l1, h1, s1, z1, l2, h2, s2, z2, l3, h3, s3, z3, x_ptr, perm_ptr,
            blocks, offs_w, offs_q, keep_lo, keep_hi, sub_lo, sub_hi, float_bits, NUM_BLOCKS, BLOCK, HAS_ZS, HAS_PERM,
            EVEN, ROWS, OFFSET, HIGH,
        )  # fmt: skip
    _store_rows(out_ptr, bias_ptr, first_out, N, _total(acc0), _total(acc1), _total(acc2), _total(acc3), ROWS,
                HAS_BIAS, GATED)  # fmt: skip

"""Weight-only products over grouped integer weights (``int4_grouped`` / ``int8_grouped``, the layout of
:mod:`engine.interfaces.grouped_int`, and the GGUF types repacked exactly into it,
:mod:`engine_plugin_sdk.grouped_codes`): ``y = x[:, perm] @ dequant(W).T (+ bias)``.

The weight stays in its codes in device memory and is dequantized in registers (``code * scale -
zero_scale``, or ``(code - ZERO) * scale`` for a weight with one zero point), accumulating in float32.
Reading 4 or 8 bits a weight instead of 16 is the point: at decode batch sizes a product is bound by the
weight's bytes. Two kernels share the layout:

- :func:`~.grouped_int_gemm_kernels.grouped_int_gemm_kernel`, a tiled GEMM: each program dequantizes
  ``[BLOCK_N, BLOCK_K]`` tiles and feeds them to ``tl.dot`` in the activations' dtype (in its own module, with
  the dense copy for many rows);
- :func:`grouped_int_gemv_kernel`, for one activation row (batch-1 decode, the LM head): each program owns
  up to four output features and streams their codes along K in wide contiguous runs, as the dense GEMV
  does, the activations read and converted once for its rows; with programmatic dependent launch
  (``USE_PDL``, :mod:`.pdl`) it loads its first tiles of codes and scales before it waits for the kernel
  that wrote ``x``. 4-bit codes in blocks of 128 columns or more take a GEMV that reads words
  (:mod:`.grouped_int4_gemv_kernels`). :func:`grouped_int_gemv_wide_kernel` computes the same with many rows
  a program, the interpreter's variant.

Codes become floats by a bit trick rather than an integer-to-float conversion (:func:`_as_float`), which
issues at a fraction of the FP32 rate on Hopper. The GEMV is still bound by its per-code instructions, not
by memory: on an H200 (``benchmarks/nvidia_h200_quantized.py kernels``, Llama-3-8B shapes) it streamed
W4A16 codes at 1.0-1.5 TB/s and Q4_K at 1.4-2.1 TB/s, against 3.6-4.2 TB/s for the bf16 GEMV, so a
product takes 0.7-1.0x the bf16 time for a quarter to a third of its bytes. The word GEMV takes 0.8-0.9x
the byte GEMV's time on W4A16 (groups of 128); on Q4_K's 32-column blocks it was slower.

The launcher repacks the weight at load (:func:`~engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers.
pack_grouped_codes`):

- codes row-major (N-major), ``[N, K]`` bytes (8-bit) or ``[N, K / 2]`` (4-bit), so that a GEMV program
  reads each of its rows as one contiguous run and a GEMM tile's rows are contiguous runs along K;
- 4-bit codes paired *within* each block of ``BLOCK_K`` columns: byte ``b * BLOCK_K / 2 + r`` of a row
  holds column ``b * BLOCK_K + r`` in its low nibble and column ``b * BLOCK_K + BLOCK_K / 2 + r`` in its
  high one. A tile then splits into two half tiles by a mask and a shift, each multiplied by its own half
  of the activation columns: no interleaving of nibbles in registers (a layout shuffle on the GPU);
- ``BLOCK_K`` divides the group size, so every block lies in one group;
- scales and zero scales ``[N, groups]``, in float16 where that holds them exactly (GPTQ's, Q4_0's), else
  float32 (the K-quants' products of two scales); a weight with one zero point has no zero scales.

The act-order permutation is a gathered load of the activations' columns (``HAS_PERM``), so it costs no
extra pass over ``x``. With ``SPLIT_K > 1`` the GEMM's reduction is split across programs, each writing
float32 partial sums that the launcher adds: that fills the GPU when few output tiles (a narrow projection)
would leave most multiprocessors idle.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.grouped_int_gemv_rows import _NOT_GATED, _program_rows, _store_rows
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_params import group_params, group_params_masked
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_begin


@triton.jit
def _as_float(codes, OFFSET: tl.constexpr):
    """``codes - OFFSET`` in float32 for codes of 0 .. 255, without an integer-to-float conversion: the
    bits ``0x4B000000 | c`` are the float ``2**23 + c`` exactly, and subtracting ``2**23 + OFFSET`` is
    exact too."""
    return (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _high_nibbles(t, one_bits):
    """float32 ``1 + low / 256`` and ``1 + high / 16`` of the byte at bits 15-22 of ``t`` (``one_bits``: 1.0's):
    each nibble at the top of the mantissa with one AND-OR, for 16-bit activations' products (no subtraction
    per code; :func:`_high_activations` matches the activations)."""
    low = ((t & 0x78000) | one_bits).to(tl.float32, bitcast=True)
    high = ((t & 0x780000) | one_bits).to(tl.float32, bitcast=True)
    return low, high


@triton.jit
def _high_activations(x_lo, x_hi, OFFSET: tl.constexpr):
    """The activations of :func:`_high_nibbles`' low and high codes times 256 and 16 (exact), and ``x_off``, what
    the floats' ones and the zero point ``OFFSET`` add to their products (to be added once for all rows):
    ``low * x_lo' + high * x_hi' + x_off = (lo - OFFSET) x_lo + (hi - OFFSET) x_hi``."""
    x_off = -(x_lo * (256.0 + OFFSET) + x_hi * (16.0 + OFFSET))
    return x_lo * 256.0, x_hi * 16.0, x_off


@triton.jit
def _dequant(codes, scale, zs, ZERO: tl.constexpr, HAS_ZS: tl.constexpr):
    """float32 weights of ``codes`` (broadcast against their group's ``scale`` / ``zs``)."""
    if HAS_ZS:
        return _as_float(codes, 0) * scale - zs
    else:
        return _as_float(codes, ZERO) * scale


@triton.jit
def _gemv_tile(w_ptr, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, row, stride_wn, stride_sn, blocks, offs_c,
               NUM_BLOCKS, BLOCK: tl.constexpr, GROUP: tl.constexpr, W_COLS: tl.constexpr, HAS_ZS: tl.constexpr,
               EVEN: tl.constexpr, SUB_GROUPS: tl.constexpr):  # fmt: skip
    """Row ``row``'s codes of sub-blocks ``blocks`` (``[SUBS, W_COLS]`` bytes, one contiguous run) and their
    float32 scales and zero scales ``[SUBS, 1]``: what nothing in a step writes."""
    cols = blocks[:, None] * W_COLS + offs_c[None, :]
    params = row.to(tl.int64) * stride_sn + blocks * BLOCK // GROUP
    w_row = w_ptr + row.to(tl.int64) * stride_wn
    if EVEN:
        codes = tl.load(w_row + cols)
        scale = group_params(scale_ptr, super_ptr, params, SUB_GROUPS)[:, None]
        zs = scale
        if HAS_ZS:
            zs = group_params(zs_ptr, zsuper_ptr, params, SUB_GROUPS)[:, None]
    else:
        ok = blocks < NUM_BLOCKS
        codes = tl.load(w_row + cols, mask=ok[:, None], other=0)
        scale = group_params_masked(scale_ptr, super_ptr, params, ok, SUB_GROUPS)[:, None]
        zs = scale
        if HAS_ZS:
            zs = group_params_masked(zs_ptr, zsuper_ptr, params, ok, SUB_GROUPS)[:, None]
    return codes, scale, zs


@triton.jit
def _gemv_tiles(w_ptr, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, r0, r1, r2, r3, stride_wn, stride_sn, blocks,
                offs_c, NUM_BLOCKS, BLOCK: tl.constexpr, GROUP: tl.constexpr, W_COLS: tl.constexpr,
                HAS_ZS: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr, SUB_GROUPS: tl.constexpr):  # fmt: skip
    """The tiles of the program's ``ROWS`` rows ``r0 .. r3`` (:func:`_program_rows`); a row beyond ``ROWS``
    repeats row 0's tile, never used."""
    c0, s0, z0 = _gemv_tile(w_ptr, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, r0, stride_wn, stride_sn, blocks, offs_c,
                            NUM_BLOCKS, BLOCK, GROUP, W_COLS, HAS_ZS, EVEN, SUB_GROUPS)  # fmt: skip
    c1, s1, z1, c2, s2, z2, c3, s3, z3 = c0, s0, z0, c0, s0, z0, c0, s0, z0
    if ROWS > 1:
        c1, s1, z1 = _gemv_tile(w_ptr, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, r1, stride_wn, stride_sn, blocks,
                                offs_c, NUM_BLOCKS, BLOCK, GROUP, W_COLS, HAS_ZS, EVEN, SUB_GROUPS)  # fmt: skip
    if ROWS > 2:
        c2, s2, z2 = _gemv_tile(w_ptr, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, r2, stride_wn, stride_sn, blocks,
                                offs_c, NUM_BLOCKS, BLOCK, GROUP, W_COLS, HAS_ZS, EVEN, SUB_GROUPS)  # fmt: skip
        c3, s3, z3 = _gemv_tile(w_ptr, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, r3, stride_wn, stride_sn, blocks,
                                offs_c, NUM_BLOCKS, BLOCK, GROUP, W_COLS, HAS_ZS, EVEN, SUB_GROUPS)  # fmt: skip
    return c0, s0, z0, c1, s1, z1, c2, s2, z2, c3, s3, z3


@triton.jit
def _gemv_x(x_ptr, perm_ptr, cols, ok, HAS_PERM: tl.constexpr, EVEN: tl.constexpr):
    """float32 activations of stored columns ``cols``: ``x[perm[cols]]``."""
    if HAS_PERM:
        if EVEN:
            cols = tl.load(perm_ptr + cols)
        else:
            cols = tl.load(perm_ptr + cols, mask=ok, other=0)
    if EVEN:
        return tl.load(x_ptr + cols).to(tl.float32)
    else:
        return tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _gemv_acc(acc, codes, scale, zs, x_lo, x_hi, x_off, x_sum, BITS: tl.constexpr, ZERO: tl.constexpr,
              HAS_ZS: tl.constexpr, HIGH: tl.constexpr):  # fmt: skip
    """``acc`` plus a dequantized tile (scales broadcast against it) times the activations."""
    if HIGH:
        # 4-bit: the byte at mantissa bits 15-22 of 1.0, 1 + low / 256 and 1 + high / 16; _gemv_step scaled the
        # activations to match and folded the ones and the zero point into x_off
        low, high = _high_nibbles(codes.to(tl.int32) << 15, 0x3F800000)
        d = tl.fma(low, x_lo, tl.fma(high, x_hi, x_off))
        if HAS_ZS:
            return tl.fma(d, scale, acc) - x_sum * zs
        return tl.fma(d, scale, acc)
    if BITS == 4:
        if HAS_ZS:
            acc += (_as_float(codes & 0xF, 0) * scale - zs) * x_lo + (_as_float(codes >> 4, 0) * scale - zs) * x_hi
        else:
            acc += (_as_float(codes & 0xF, ZERO) * x_lo + _as_float(codes >> 4, ZERO) * x_hi) * scale
    else:
        if HAS_ZS:
            acc += (_as_float(codes, 0) * scale - zs) * x_lo
        else:
            acc += _as_float(codes, ZERO) * x_lo * scale
    return acc


@triton.jit
def _gemv_step(acc0, acc1, acc2, acc3, c0, s0, z0, c1, s1, z1, c2, s2, z2, c3, s3, z3, x_ptr, perm_ptr, blocks,
               offs_c, NUM_BLOCKS, BLOCK: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr,
               HAS_ZS: tl.constexpr, HAS_PERM: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr,
               HIGH: tl.constexpr):  # fmt: skip
    """The rows' accumulators plus their tiles against the activations, read and converted once for all
    ``ROWS`` rows (the reason the rows are unrolled rather than a dimension of one tile)."""
    cols = blocks[:, None] * BLOCK + offs_c[None, :]
    ok = (blocks < NUM_BLOCKS)[:, None]
    x_lo = _gemv_x(x_ptr, perm_ptr, cols, ok, HAS_PERM, EVEN)
    x_hi = x_lo
    if BITS == 4:
        x_hi = _gemv_x(x_ptr, perm_ptr, cols + BLOCK // 2, ok, HAS_PERM, EVEN)
    x_off, x_sum = x_lo, x_lo
    if HIGH:
        # the activations of codes read as 1 + code / 256 and 1 + code / 16: times 256 and 16, exact; what the
        # ones and the zero point add comes off once for all the rows
        OFFSET: tl.constexpr = 0 if HAS_ZS else ZERO
        x_sum = x_lo + x_hi
        x_lo, x_hi, x_off = _high_activations(x_lo, x_hi, OFFSET)
    acc0 = _gemv_acc(acc0, c0, s0, z0, x_lo, x_hi, x_off, x_sum, BITS, ZERO, HAS_ZS, HIGH)
    if ROWS > 1:
        acc1 = _gemv_acc(acc1, c1, s1, z1, x_lo, x_hi, x_off, x_sum, BITS, ZERO, HAS_ZS, HIGH)
    if ROWS > 2:
        acc2 = _gemv_acc(acc2, c2, s2, z2, x_lo, x_hi, x_off, x_sum, BITS, ZERO, HAS_ZS, HIGH)
        acc3 = _gemv_acc(acc3, c3, s3, z3, x_lo, x_hi, x_off, x_sum, BITS, ZERO, HAS_ZS, HIGH)
    return acc0, acc1, acc2, acc3


@triton.jit
def grouped_int_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr,
    N, stride_wn, stride_sn,
    NUM_BLOCKS: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr,
    HAS_ZS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SUBS: tl.constexpr, EVEN: tl.constexpr, USE_PDL: tl.constexpr,
    HIGH: tl.constexpr = False, LOOP_STAGES: tl.constexpr = 1, GATED: tl.constexpr = -1, super_ptr=None,
    zsuper_ptr=None, SUB_GROUPS: tl.constexpr = 0,
):  # fmt: skip
    """``out[n] = sum_k x[perm[k]] * W[n, k] (+ bias[n])`` for ``ROWS`` (1, 2 or 4) output features ``n``;
    with ``GATED`` (``ROWS`` 4, no bias) ``act(gate[f]) * up[f]`` for two features of a weight stacking its gate
    rows over its up rows (``out``: ``N / 2``).

    Each row's ``NUM_BLOCKS`` sub-blocks of ``BLOCK`` columns (the packing's ``block_k``) are read ``SUBS``
    at a time, ``SUBS * BLOCK / 2`` contiguous bytes for 4 bits. ``EVEN`` says ``SUBS`` divides
    ``NUM_BLOCKS`` (no masks along K). ``out`` is ``[N]`` in its own dtype (float32 stores the accumulator
    unrounded, as the logits want). ``HIGH`` (4-bit codes, 16-bit activations): codes go to the top of a
    float's mantissa, without a subtraction each (as in :mod:`.grouped_int4_gemv_kernels`).
    """
    tl.static_assert(GATED == _NOT_GATED or (ROWS == 4 and not HAS_BIAS), "a gated GEMV runs 4 rows, no bias")
    r0, r1, r2, r3, first_out = _program_rows(N, ROWS, GATED)
    W_COLS: tl.constexpr = BLOCK // 2 if BITS == 4 else BLOCK
    offs_c = tl.arange(0, W_COLS)
    offs_j = tl.arange(0, SUBS)
    acc0 = tl.zeros((SUBS, W_COLS), dtype=tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    first = 0
    if USE_PDL:
        # the weight is constant: its first tiles are read while the kernel that writes x drains
        gdc_launch_dependents()
        c0, s0, z0, c1, s1, z1, c2, s2, z2, c3, s3, z3 = _gemv_tiles(
            w_ptr, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, r0, r1, r2, r3, stride_wn, stride_sn, offs_j, offs_c,
            NUM_BLOCKS, BLOCK, GROUP, W_COLS, HAS_ZS, EVEN, ROWS, SUB_GROUPS,
        )  # fmt: skip
        gdc_wait()
        acc0, acc1, acc2, acc3 = _gemv_step(
            acc0, acc1, acc2, acc3, c0, s0, z0, c1, s1, z1, c2, s2, z2, c3, s3, z3, x_ptr, perm_ptr, offs_j,
            offs_c, NUM_BLOCKS, BLOCK, BITS, ZERO, HAS_ZS, HAS_PERM, EVEN, ROWS, HIGH,
        )  # fmt: skip
        first = SUBS
    # past the first tile, Triton's pipeliner reads LOOP_STAGES - 1 iterations' tiles ahead (cp.async through
    # shared memory); a plain loop waits for each iteration's tiles
    for b0 in tl.range(first, NUM_BLOCKS, SUBS, num_stages=LOOP_STAGES):
        blocks = b0 + offs_j
        c0, s0, z0, c1, s1, z1, c2, s2, z2, c3, s3, z3 = _gemv_tiles(
            w_ptr, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, r0, r1, r2, r3, stride_wn, stride_sn, blocks, offs_c,
            NUM_BLOCKS, BLOCK, GROUP, W_COLS, HAS_ZS, EVEN, ROWS, SUB_GROUPS,
        )  # fmt: skip
        acc0, acc1, acc2, acc3 = _gemv_step(
            acc0, acc1, acc2, acc3, c0, s0, z0, c1, s1, z1, c2, s2, z2, c3, s3, z3, x_ptr, perm_ptr, blocks,
            offs_c, NUM_BLOCKS, BLOCK, BITS, ZERO, HAS_ZS, HAS_PERM, EVEN, ROWS, HIGH,
        )  # fmt: skip
    _store_rows(out_ptr, bias_ptr, first_out, N, tl.sum(tl.sum(acc0, axis=1), axis=0),
                tl.sum(tl.sum(acc1, axis=1), axis=0), tl.sum(tl.sum(acc2, axis=1), axis=0),
                tl.sum(tl.sum(acc3, axis=1), axis=0), ROWS, HAS_BIAS, GATED)  # fmt: skip


@triton.jit
def grouped_int_gemv_wide_kernel(
    x_ptr, w_ptr, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr,
    N, stride_wn, stride_sn,
    NUM_BLOCKS: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr,
    HAS_ZS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SUBS: tl.constexpr, EVEN: tl.constexpr, USE_PDL: tl.constexpr,
    super_ptr=None, zsuper_ptr=None, SUB_GROUPS: tl.constexpr = 0,
):  # fmt: skip
    """:func:`grouped_int_gemv_kernel` with its ``ROWS`` (a power of two) as a dimension of one tile
    ``[ROWS, SUBS, W_COLS]``: a few programs of many rows, as Triton's interpreter wants (each program's
    operations cost it the same whatever their size; the unrolled kernel's many small ones made the tests
    and an interpreted model slow). On the GPU each warp then holds other rows and reads and converts the
    activations for them itself: at four rows it measured 10-20% slower than the unrolled kernel on Q4_K
    and about even on W4A16 (an H200, Llama-3-8B shapes), so the GPU tiles use the unrolled one. With PDL
    it waits at once."""
    offs_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    W_COLS: tl.constexpr = BLOCK // 2 if BITS == 4 else BLOCK
    offs_c = tl.arange(0, W_COLS)
    offs_j = tl.arange(0, SUBS)
    w_rows = w_ptr + rows * stride_wn
    s_rows = rows * stride_sn
    acc = tl.zeros((ROWS, SUBS, W_COLS), dtype=tl.float32)
    pdl_begin(USE_PDL)
    for b0 in range(0, NUM_BLOCKS, SUBS):
        blocks = b0 + offs_j
        cols = blocks[:, None] * W_COLS + offs_c[None, :]
        params = s_rows[:, None] + (blocks * BLOCK // GROUP)[None, :]
        ok = blocks < NUM_BLOCKS
        codes = tl.load(w_rows[:, None, None] + cols[None, :, :], mask=ok[None, :, None], other=0)
        scale = group_params_masked(scale_ptr, super_ptr, params, ok[None, :], SUB_GROUPS)[:, :, None]
        zs = scale
        if HAS_ZS:
            zs = group_params_masked(zs_ptr, zsuper_ptr, params, ok[None, :], SUB_GROUPS)[:, :, None]
        xcols = blocks[:, None] * BLOCK + offs_c[None, :]
        x_lo = _gemv_x(x_ptr, perm_ptr, xcols, ok[:, None], HAS_PERM, EVEN)[None]
        x_hi = x_lo
        if BITS == 4:
            x_hi = _gemv_x(x_ptr, perm_ptr, xcols + BLOCK // 2, ok[:, None], HAS_PERM, EVEN)[None]
        acc = _gemv_acc(acc, codes, scale, zs, x_lo, x_hi, x_lo, x_lo, BITS, ZERO, HAS_ZS, False)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)

"""The product of 1 to 8 activation rows (decode, the LM head, small verification batches) with 4-bit grouped
codes, each 32-bit word of codes read straight into a tensor-core fragment: ``out[m, n] = sum_k x[m, perm[k]] *
W[n, k] (+ bias[n])``, in the packed layout of :mod:`.grouped_int_kernels` (byte ``r`` of a block of ``BLOCK``
columns holds column ``r`` in its low nibble and column ``BLOCK / 2 + r`` in its high one), unchanged.

Why: at batch 1 the CUDA-core GEMVs spend five or more instructions a code turning codes into floats and
multiplying them (an H200 streamed 4-bit weights at under 2 TB/s, bound by issue, not by memory), and a
``tl.dot`` over dequantized tiles moves every tile through shared memory. A warp-level ``mma.m16n8k16`` takes
its operands from registers: lane ``l = 4 g + t`` holds weight rows ``g`` and ``g + 8`` at reduction slots
``2t, 2t + 1, 2t + 8, 2t + 9`` and activation row ``g`` at the same slots. Which reduction column a slot stands
for is free as long as both operands agree, so a lane reads the 16 bytes ``16 t .. 16 t + 15`` of a 128-column
chunk of each of its two weight rows (vector loads, no repacking) and takes, from each word, bytes 0 and 2
(then 1 and 3) as one slot pair: one AND-OR a pair of nibbles makes the bf16 ``128 + code`` (fp16 ``1024 +
code``), so a word of eight codes costs three shifts and four logical ops, and two ``mma`` do its
multiply-adds. The activations come as bf16 pairs whose halves a byte permute matches to those slots. A
second ``mma`` with ones in place of the codes sums the activations, and ``(128 + zero) * sum`` comes off once
a chunk, with the group scale, in float32.

Each program takes 16 output features; its warps split the chunks and their sums are added at the end. A warp
reads its chunks' words ``DEPTH`` iterations ahead (``GroupedIntTiles.fragment_depth``): ptxas places a loop's
loads after most of its ``mma`` work, so a read-ahead of one iteration leaves a memory latency a chunk exposed
(``benchmarks/sass_shape.py`` shows where the loads land). (Triton's pipeliner, ``cp.async`` copies through
shared memory with two block barriers an iteration, ran 5-8 times slower on an H200, 2026-12-05.) A gate/up
product (``GATED``) takes 8 features a program, each lane holding a feature's gate row and its up row, and
writes ``act(gate) * up``. The PTX assumes that the lane holding element ``i`` of a ``[32 * warps, 4]`` tensor is ``i % 32`` of warp
``i // 32`` (Triton's blocked layout for those loads); the H200 checks compare the result with a float64
reference. The interpreter cannot run PTX: there (``ASM`` off) :mod:`.grouped_int4_fragment_mma` computes
what the ``mma`` instructions would from the same registers, lane by lane, which checks the slot mapping.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import gated_product
from engine_plugin_sdk.gpu.triton_kernels.grouped_int4_fragment_mma import _chunk_products
from engine_plugin_sdk.gpu.triton_kernels.grouped_int4_fragment_scaled import (
    _lane_params,
    _scaled_chunk_products,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_gemv_rows import _NOT_GATED
from engine_plugin_sdk.gpu.triton_kernels.l2_prefetch import prefetch_l2
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait

#: what the chunk loads give past the last chunk (``PAST``): every chunk they read is real, zeros, or anything
#: (a read-ahead whose values are never used: the last chunk again, without the zeros and predicates of a mask)
ALL_REAL: tl.constexpr = tl.constexpr(0)
ZEROS: tl.constexpr = tl.constexpr(1)
UNUSED: tl.constexpr = tl.constexpr(2)


@triton.jit
def _masked(ptrs, ok, PAST: tl.constexpr):
    if PAST == ZEROS:
        return tl.load(ptrs, mask=ok, other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def _x_pairs(x_row, perm_ptr, cols, ok, HAS_PERM: tl.constexpr, PAST: tl.constexpr):
    """int32 ``[LANES, 4]``: the 16-bit floats of columns ``cols + 2j`` (low half) and ``cols + 2j + 1`` (high
    half) of the activation row at ``x_row`` (``x[perm[..]]`` with ``HAS_PERM``), past the last chunk (not
    ``ok``) as ``PAST`` says."""
    j = tl.arange(0, 4)[None, :]
    if HAS_PERM:
        # past the last chunk the columns are 0 (a real address), whatever PAST says
        c0 = _masked(perm_ptr + cols[:, None] + 2 * j, ok[:, None], ALL_REAL if PAST == ALL_REAL else ZEROS)
        c1 = _masked(perm_ptr + cols[:, None] + 2 * j + 1, ok[:, None], ALL_REAL if PAST == ALL_REAL else ZEROS)
        lo = tl.load(x_row[:, None] + c0).to(tl.int16, bitcast=True)
        hi = tl.load(x_row[:, None] + c1).to(tl.int16, bitcast=True)
        return (lo.to(tl.int32) & 0xFFFF) | (hi.to(tl.int32) << 16)
    else:
        # cols is even: the pairs are whole 32-bit words
        x32 = x_row.to(tl.pointer_type(tl.int32))
        return _masked(x32[:, None] + (cols // 2)[:, None] + j, ok[:, None], PAST)


@triton.jit
def _chunk_words(w32, row_g, row_h, stride_w, words, warp, c0, NUM_CHUNKS: tl.constexpr, PAST: tl.constexpr):
    """The lanes' words ``[LANES, 4]`` of rows ``g`` and ``g + 8`` in chunk ``c0 + warp`` (past the last chunk as
    ``PAST`` says)."""
    ok = (c0 + warp < NUM_CHUNKS)[:, None]
    if PAST == UNUSED:
        c0 = tl.minimum(c0 + warp, NUM_CHUNKS - 1) - warp
    offs = (words + 16 * c0)[:, None] + tl.arange(0, 4)[None, :]
    return _masked(w32 + row_g[:, None] * stride_w + offs, ok, PAST), _masked(w32 + row_h[:, None] * stride_w + offs,
                                                                                ok, PAST)  # fmt: skip


@triton.jit
def _prefetch_chunk(w32, row_g, row_h, stride_w, words, warp, c0, NUM_CHUNKS: tl.constexpr, ASM: tl.constexpr):
    """Ask the L2 cache for the lanes' words of rows ``g`` and ``g + 8`` in chunk ``c0 + warp`` (none past the
    last chunk)."""
    ok = c0 + warp < NUM_CHUNKS
    offs = words + 16 * c0
    prefetch_l2(w32 + row_g * stride_w + offs, ok, ASM)
    prefetch_l2(w32 + row_h * stride_w + offs, ok, ASM)


@triton.jit
def _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, chunk, NUM_CHUNKS: tl.constexpr, PER_BLOCK: tl.constexpr,
                  BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_ZS: tl.constexpr, PAST: tl.constexpr):  # fmt: skip
    """float32 group scales (and zero scales; the scales again without) ``[LANES, 4]`` of the lanes' rows
    ``row_j`` in chunk ``chunk`` ``[LANES]`` (past the last chunk as ``PAST`` says)."""
    ok = (chunk < NUM_CHUNKS)[:, None]
    if PAST == UNUSED:
        chunk = tl.minimum(chunk, NUM_CHUNKS - 1)
    group = ((chunk // PER_BLOCK) * BLOCK // GROUP)[:, None]
    scale = _masked(scale_ptr + row_j * stride_sn + group, ok, PAST).to(tl.float32)
    zs = scale
    if HAS_ZS:
        zs = _masked(zs_ptr + row_j * stride_sn + group, ok, ZEROS if PAST == ALL_REAL else PAST).to(tl.float32)
    return scale, zs


@triton.jit
def _chunk_x(x_row, perm_ptr, chunk, t, NUM_CHUNKS: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
             HAS_PERM: tl.constexpr, PAST: tl.constexpr):  # fmt: skip
    """The four registers of activation pairs ``[LANES, 4]`` each of chunk ``chunk`` ``[LANES]``: lane ``t``'s low
    columns are ``16 t .. 16 t + 15`` of the chunk's 64 within its block, its high ones ``BLOCK / 2`` on (blocks
    narrower than 128 columns: lane ``t``'s 16 bytes are its block's, at ``BLOCK / 32`` lanes a block)."""
    ok = chunk < NUM_CHUNKS
    if PAST == UNUSED:
        chunk = tl.minimum(chunk, NUM_CHUNKS - 1)
    if BLOCK < 128:
        cols = chunk * 128 + (t // (BLOCK // 32)) * BLOCK + 16 * (t % (BLOCK // 32))
    elif PER_BLOCK == 1:
        cols = chunk * BLOCK + 16 * t
    else:
        cols = (chunk // PER_BLOCK) * BLOCK + (chunk % PER_BLOCK) * 64 + 16 * t
    xl0 = _x_pairs(x_row, perm_ptr, cols, ok, HAS_PERM, PAST)
    xl1 = _x_pairs(x_row, perm_ptr, cols + 8, ok, HAS_PERM, PAST)
    xh0 = _x_pairs(x_row, perm_ptr, cols + BLOCK // 2, ok, HAS_PERM, PAST)
    xh1 = _x_pairs(x_row, perm_ptr, cols + BLOCK // 2 + 8, ok, HAS_PERM, PAST)
    return xl0, xl1, xh0, xh1


@triton.jit
def _read_ahead_chunks(acc, w32, row_g, row_h, row_j, stride_w, words, warp, t, x_row, perm_ptr, scale_ptr, zs_ptr,
                       super_ptr, zsuper_ptr, stride_sn, NUM_CHUNKS: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                       GROUP: tl.constexpr, HAS_ZS: tl.constexpr, HAS_PERM: tl.constexpr, NOW: tl.constexpr,
                       LATER: tl.constexpr, WARPS: tl.constexpr, BASE: tl.constexpr, OFFSET: tl.constexpr,
                       FP16: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, DEPTH: tl.constexpr,
                       AHEAD: tl.constexpr, PREFETCH: tl.constexpr, SUB_BITS: tl.constexpr, SUB_GROUPS: tl.constexpr):  # fmt: skip
    """The kernel's reduction with each warp's words read ``DEPTH`` iterations ahead in registers (with
    ``AHEAD`` their scales too, the activations one iteration ahead), and with ``PREFETCH`` asked of the L2
    cache that many iterations further ahead."""
    # the weight is constant: the first DEPTH iterations' words (and with AHEAD their scales) are read before
    # the wait for x (why DEPTH: the module's docstring)
    wg, wh = _chunk_words(w32, row_g, row_h, stride_w, words, warp, 0, NUM_CHUNKS, NOW)
    wg1, wh1, wg2, wh2 = wg, wh, wg, wh
    if DEPTH > 1:
        wg1, wh1 = _chunk_words(w32, row_g, row_h, stride_w, words, warp, WARPS, NUM_CHUNKS, LATER)
    if DEPTH > 2:
        wg2, wh2 = _chunk_words(w32, row_g, row_h, stride_w, words, warp, 2 * WARPS, NUM_CHUNKS, LATER)
    if AHEAD:
        sc, zc = _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, warp, NUM_CHUNKS, PER_BLOCK, BLOCK, GROUP, HAS_ZS,
                               NOW)  # fmt: skip
        sc1, zc1, sc2, zc2 = sc, zc, sc, zc
    if AHEAD and DEPTH > 1:
        sc1, zc1 = _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, warp + WARPS, NUM_CHUNKS, PER_BLOCK, BLOCK,
                                 GROUP, HAS_ZS, LATER)  # fmt: skip
    if AHEAD and DEPTH > 2:
        sc2, zc2 = _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, warp + 2 * WARPS, NUM_CHUNKS, PER_BLOCK, BLOCK,
                                 GROUP, HAS_ZS, LATER)  # fmt: skip
    for p in tl.static_range(DEPTH, DEPTH + PREFETCH):
        _prefetch_chunk(w32, row_g, row_h, stride_w, words, warp, p * WARPS, NUM_CHUNKS, ASM)
    if USE_PDL:
        gdc_wait()
    if AHEAD:
        xl0, xl1, xh0, xh1 = _chunk_x(x_row, perm_ptr, warp, t, NUM_CHUNKS, PER_BLOCK, BLOCK, HAS_PERM, NOW)
    for c0 in range(0, NUM_CHUNKS, WARPS):
        chunk = c0 + warp
        if PREFETCH > 0:
            _prefetch_chunk(w32, row_g, row_h, stride_w, words, warp, c0 + (DEPTH + PREFETCH) * WARPS, NUM_CHUNKS,
                            ASM)  # fmt: skip
        wg_next, wh_next = _chunk_words(w32, row_g, row_h, stride_w, words, warp, c0 + DEPTH * WARPS, NUM_CHUNKS,
                                        LATER)  # fmt: skip
        if AHEAD:
            # without it ptxas issues the scales' loads amid the iteration that multiplies by them and the
            # activations' at its top: a memory latency each, every iteration
            sc_next, zc_next = _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, chunk + DEPTH * WARPS, NUM_CHUNKS,
                                             PER_BLOCK, BLOCK, GROUP, HAS_ZS, LATER)  # fmt: skip
            xn0, xn1, xn2, xn3 = _chunk_x(x_row, perm_ptr, chunk + WARPS, t, NUM_CHUNKS, PER_BLOCK, BLOCK, HAS_PERM,
                                          LATER)  # fmt: skip
        else:
            xl0, xl1, xh0, xh1 = _chunk_x(x_row, perm_ptr, chunk, t, NUM_CHUNKS, PER_BLOCK, BLOCK, HAS_PERM, NOW)
        if BLOCK < 128:
            # each lane's block has its own scales: into the operands (grouped_int4_fragment_scaled)
            group = (chunk * 128 + (t // (BLOCK // 32)) * BLOCK) // GROUP
            params = _lane_params(scale_ptr, zs_ptr, super_ptr, zsuper_ptr, row_g, row_h, stride_sn, group,
                                  chunk < NUM_CHUNKS, HAS_ZS, FP16, SUB_GROUPS)  # fmt: skip
            acc += _scaled_chunk_products(wg, wh, xl0, xl1, xh0, xh1, params, WARPS, OFFSET - BASE, SUB_BITS, FP16,
                                          ASM)  # fmt: skip
        else:
            c, s = _chunk_products(wg, wh, xl0, xl1, xh0, xh1, WARPS, BASE, FP16, ASM)
            if not AHEAD:
                sc, zc = _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, chunk, NUM_CHUNKS, PER_BLOCK, BLOCK,
                                       GROUP, HAS_ZS, NOW)  # fmt: skip
            acc += sc * (c - OFFSET * s)
            if HAS_ZS:
                acc -= zc * s
        if DEPTH == 1:
            wg, wh = wg_next, wh_next
        elif DEPTH == 2:
            wg, wh, wg1, wh1 = wg1, wh1, wg_next, wh_next
        else:
            wg, wh, wg1, wh1, wg2, wh2 = wg1, wh1, wg2, wh2, wg_next, wh_next
        if AHEAD:
            xl0, xl1, xh0, xh1 = xn0, xn1, xn2, xn3
            if DEPTH == 1:
                sc, zc = sc_next, zc_next
            elif DEPTH == 2:
                sc, zc, sc1, zc1 = sc1, zc1, sc_next, zc_next
            else:
                sc, zc, sc1, zc1, sc2, zc2 = sc1, zc1, sc2, zc2, sc_next, zc_next
    return acc


@triton.jit
def grouped_int4_fragment_kernel(
    x_ptr, w_ptr, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_wn, stride_sn, stride_om,
    NUM_CHUNKS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, WARPS: tl.constexpr,
    FP16: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, DEPTH: tl.constexpr = 1,
    AHEAD: tl.constexpr = False, GATED: tl.constexpr = -1, PREFETCH: tl.constexpr = 0, SUB_BITS: tl.constexpr = 0,
    super_ptr=None, zsuper_ptr=None, SUB_GROUPS: tl.constexpr = 0,
):  # fmt: skip
    """``out[m, n]`` for the program's 16 output features ``n`` and the ``M <= 8`` activation rows; or, with
    ``GATED`` (an activation of :func:`.elementwise_kernels.gated_product`), ``act(gate) * up`` of 8 features
    ``f`` whose gate rows ``f`` and up rows ``N / 2 + f`` the weight stacks (``out``: ``[M, N / 2]``), the lanes
    holding gate and up rows where a plain product holds rows ``g`` and ``g + 8``: one launch, no round trip.

    ``x``: ``[M, K]`` bf16 (fp16 with ``FP16``), rows ``stride_xm`` apart (even), 4-byte aligned; ``w``, ``scale``,
    ``zs``, ``perm``, ``bias`` as for :func:`~.grouped_int_gemm_kernels.grouped_int_gemm_kernel` (``BLOCK`` 32, 64 or
    a multiple of 128, ``stride_wn`` a multiple of 16 bytes); ``out``: ``[M, N]`` in its dtype. ``WARPS`` must be the launch's
    ``num_warps``; ``NUM_CHUNKS`` is ``K / 128``. ``DEPTH`` (1-3): how many iterations ahead a warp reads
    its chunks' words. ``AHEAD``: their group scales too, and the activations one iteration ahead.
    ``PREFETCH``: the L2 cache is asked for each chunk's words that many iterations before the
    read-ahead loads them (no registers held; the interpreter skips it).
    Blocks of 32 or 64 columns take each lane's scales into its operands
    (:mod:`.grouped_int4_fragment_scaled`; ``SUB_BITS``: ``-(BASE + zero)`` twice over in the 16-bit type, the
    zero being ``ZERO``, or 0 with zero scales; no ``AHEAD``).
    """
    tl.static_assert(DEPTH >= 1 and DEPTH <= 3, "the fragment kernel reads words 1 to 3 iterations ahead")
    tl.static_assert(BLOCK >= 128 or not AHEAD, "blocks under 128 columns take their scales in the operands")
    LANES: tl.constexpr = 32 * WARPS
    BASE: tl.constexpr = 1024 if FP16 else 128
    # the codes come as BASE + code: the offset (zero point, or BASE alone with zero scales) off the sums
    OFFSET: tl.constexpr = BASE + (0 if HAS_ZS else ZERO)
    PER_BLOCK: tl.constexpr = 1 if BLOCK < 128 else BLOCK // 128
    EVEN: tl.constexpr = NUM_CHUNKS % WARPS == 0
    # loads of the iteration's own chunk, and of chunks read ahead (past the last one with AHEAD, unused)
    NOW: tl.constexpr = ALL_REAL if EVEN else ZEROS
    LATER: tl.constexpr = UNUSED if AHEAD and EVEN else ZEROS
    lane = tl.arange(0, LANES)
    warp = lane // 32
    g = (lane % 32) // 4
    t = lane % 4
    j = tl.arange(0, 4)[None, :]
    if GATED == _NOT_GATED:
        row0 = tl.program_id(0) * 16
        row_g = tl.minimum(row0 + g, N - 1).to(tl.int64)
        row_h = tl.minimum(row0 + g + 8, N - 1).to(tl.int64)
    else:
        row0 = tl.program_id(0) * 8
        row_g = tl.minimum(row0 + g, N // 2 - 1).to(tl.int64)
        row_h = row_g + N // 2
    # registers j = 0, 1 hold row g's sums, 2, 3 row h's
    row_j = tl.where(j // 2 == 0, row_g[:, None], row_h[:, None])
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    stride_w = stride_wn // 4
    words = 16 * warp + 4 * t  # this lane's words in chunk 0 (each chunk 16 words a row)
    # lane g holds activation row g as the mma's column g: lanes past M read row M - 1 into columns whose
    # sums are never stored (a column of the product depends on its own column of activations alone)
    x_row = x_ptr + tl.minimum(g, M - 1) * stride_xm
    acc = tl.zeros((LANES, 4), dtype=tl.float32)
    if USE_PDL:
        gdc_launch_dependents()
    acc = _read_ahead_chunks(acc, w32, row_g, row_h, row_j, stride_w, words, warp, t, x_row, perm_ptr, scale_ptr,
                             zs_ptr, super_ptr, zsuper_ptr, stride_sn, NUM_CHUNKS, PER_BLOCK, BLOCK, GROUP, HAS_ZS,
                             HAS_PERM, NOW, LATER, WARPS, BASE, OFFSET, FP16, ASM, USE_PDL, DEPTH, AHEAD, PREFETCH,
                             SUB_BITS, SUB_GROUPS)  # fmt: skip
    total = tl.sum(tl.reshape(acc, (WARPS, 32, 4)), axis=0)
    lane32 = tl.arange(0, 32)[:, None]
    if GATED == _NOT_GATED:
        n_out = 2 * (lane32 % 4) + j % 2
        feature = row0 + lane32 // 4 + 8 * (j // 2)
        store_ok = (n_out < M) & (feature < N)
        if HAS_BIAS:
            total += tl.load(bias_ptr + feature, mask=feature < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + n_out.to(tl.int64) * stride_om + feature, total.to(out_ptr.dtype.element_ty),
                 mask=store_ok)  # fmt: skip
    else:
        tl.static_assert(not HAS_BIAS, "a gated product takes no bias")
        half = N // 2
        feature = row0 + lane32 // 4
        # [lane, j] as [lane, j % 2, j // 2]: the gate's sums (j // 2 == 0) beside the up rows'
        gate, up = tl.split(tl.permute(tl.reshape(total, (32, 2, 2)), (0, 2, 1)))
        n_out = 2 * (lane32 % 4) + tl.arange(0, 2)[None, :]
        store_ok = (n_out < M) & (feature < half)
        tl.store(out_ptr + n_out.to(tl.int64) * stride_om + feature,
                 gated_product(gate, up, GATED).to(out_ptr.dtype.element_ty), mask=store_ok)  # fmt: skip

"""The single-row product over 4- or 8-bit grouped codes by integer dot products: ``out[n] = sum_k x[perm[k]] *
W[n, k] (+ bias[n])`` for batch-1 decode, in the packed layout of :mod:`.grouped_int_kernels` (byte ``r`` of a
block of ``BLOCK`` columns holds column ``r`` in its low nibble and column ``BLOCK / 2 + r`` in its high one;
8-bit codes a byte a column), unchanged.

Why: the float GEMVs turn every code into a float before they multiply it. The word GEMV
(:mod:`.grouped_int4_gemv_kernels`) spends three shifts and eight logical ops a word of eight codes on that, all
on the integer pipe, which issues at half the FMA pipe's rate on Hopper; with its multiply-adds, its sums and its
activations' conversions it ran about six instructions a code, and Nsight Compute found it bound by issue. Here
the activations become 16-bit integers once a program, and ``dp2a`` (two 16-bit x 8-bit products added to a
32-bit sum, one instruction) multiplies them by the codes where they sit in the word's bytes: a word of eight
codes costs two ANDs (the low nibbles as bytes, the high ones as bytes times 16) and four ``dp2a``.

Each thread (a *slot*) takes 16 bytes of a row a step, four words: slot ``q`` of its block holds the low nibbles
of columns ``16 q .. 16 q + 15`` and the high nibbles of ``BLOCK / 2 + 16 q ..``; its activations are those two
runs of 16, read as eight pairs each. Word ``j``'s byte ``k`` is column ``16 q + 4 j + k``: ``dp2a.lo`` takes
bytes 0 and 1 against the pair of columns ``4 j, 4 j + 1`` and ``dp2a.hi`` bytes 2 and 3 against the next pair.
A slot's integer sum times its activations' scale is its share of the row's product in the group's codes; the
group scale (and the zero point or zero scale, against the slot's activation sum) apply once a slot a step.
8-bit codes (GGUF's Q6_K / Q8_0, 8-bit GPTQ) take 16 consecutive columns a slot, a word two ``dp2a`` as it is.

Precision: a slot's 32 activations (16 for 8-bit codes) are scaled by the power of two that takes their largest
magnitude below 2**15 and rounded to integers: exact for every bf16 activation within 2**7 of the largest (fp16:
2**4), else within 2**-16 of the largest; the integer sums are exact (below 2**28 a slot a step), and the float32
sums as in the other GEMVs. An infinite or NaN activation makes its slot's share, and so the row, NaN.

The slot's dot products (PTX on sm_61 and later; in the interpreter, ``ASM`` off, the same integer sums with plain
ops) are :mod:`.grouped_int_dot_products`'.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import gated_product
from engine_plugin_sdk.gpu.triton_kernels.grouped_int4_fragment_mma import _halves
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_products import _slot_dots
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_gemv_rows import _NOT_GATED
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_params import group_params, group_params_masked
from engine_plugin_sdk.gpu.triton_kernels.l2_prefetch import prefetch_l2
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait

#: 1.5 * 2**23: added to a float below 2**22 in magnitude it leaves the rounded integer in the low mantissa bits
_ROUNDING = tl.constexpr(12582912.0)


@triton.jit
def _program_rows(N, ROWS: tl.constexpr, GATED: tl.constexpr):
    """The program's weight rows ``[ROWS]`` (past ``N`` the last again, never stored) and its first output feature:
    ``ROWS`` consecutive rows, or with ``GATED`` the gate rows of ``ROWS / 2`` features then their up rows."""
    if GATED == _NOT_GATED:
        first = tl.program_id(0) * ROWS
        return tl.minimum(first + tl.arange(0, ROWS), N - 1).to(tl.int64), first
    else:
        F: tl.constexpr = ROWS // 2
        first = tl.program_id(0) * F
        gate = tl.minimum(first + tl.arange(0, F), N // 2 - 1)
        rows = tl.reshape(tl.permute(tl.join(gate, gate + N // 2), (1, 0)), (ROWS,))
        return rows.to(tl.int64), first


@triton.jit
def _store(out_ptr, bias_ptr, first, N, y, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """The program's outputs from its rows' sums ``y [ROWS]`` (:func:`_program_rows`' rows)."""
    if GATED == _NOT_GATED:
        feature = first + tl.arange(0, ROWS)
        if HAS_BIAS:
            y += tl.load(bias_ptr + feature, mask=feature < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + feature, y.to(out_ptr.dtype.element_ty), mask=feature < N)
    else:
        F: tl.constexpr = ROWS // 2
        gate, up = tl.split(tl.permute(tl.reshape(y, (2, F)), (1, 0)))
        feature = first + tl.arange(0, F)
        tl.store(out_ptr + feature, gated_product(gate, up, GATED).to(out_ptr.dtype.element_ty), mask=feature < N // 2)


@triton.jit
def _pairs(x_ptr, perm_ptr, cols, ok, HAS_PERM: tl.constexpr, EVEN: tl.constexpr):
    """int32 ``[S, 4]``: the 16-bit activations of columns ``cols + 2j`` (low half) and ``cols + 2j + 1`` (high),
    read as one flat run of ``4 S`` (so that a thread holds its slot's four, as it holds its words)."""
    S: tl.constexpr = cols.shape[0]
    flat = tl.arange(0, 4 * S)
    at = tl.reshape(tl.broadcast_to(cols[:, None], (S, 4)), (4 * S,)) + 2 * (flat % 4)
    fine = tl.reshape(tl.broadcast_to(ok[:, None], (S, 4)), (4 * S,))
    if HAS_PERM:
        c0 = tl.load(perm_ptr + at, mask=fine, other=0)
        c1 = tl.load(perm_ptr + at + 1, mask=fine, other=0)
        lo = tl.load(x_ptr + c0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = tl.load(x_ptr + c1).to(tl.int16, bitcast=True).to(tl.int32)
        pairs = tl.where(fine, lo | (hi << 16), 0)
    else:
        # cols is even: the pairs are whole 32-bit words
        ptrs = x_ptr.to(tl.pointer_type(tl.int32)) + tl.max_contiguous(tl.multiple_of(at // 2, 4), 4)
        if EVEN:
            pairs = tl.load(ptrs)
        else:
            pairs = tl.load(ptrs, mask=fine, other=0)
    return tl.reshape(pairs, (S, 4))


@triton.jit
def _as_int16(lo, hi, inv, ASM: tl.constexpr):
    """int16 pairs (low half ``lo``) of ``round(v * inv)``, each below 2**15 in magnitude."""
    a = (lo * inv + _ROUNDING).to(tl.int32, bitcast=True)
    b = (hi * inv + _ROUNDING).to(tl.int32, bitcast=True)
    if ASM:
        # one byte permute instead of a mask, a shift and an OR
        return tl.inline_asm_elementwise(asm="prmt.b32 $0, $1, $2, 0x5410;", constraints="=r,r,r", args=[a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    return (a & 0xFFFF) | (b << 16)


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _largest_of_four(t):
    """The largest of each row of a ``[S, 4]`` tensor (a thread's own four), NaN if any is."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return _nan_max(_nan_max(a0, a1), _nan_max(b0, b1))


@triton.jit
def _integer_pairs(xl0, xl1, xh0, xh1, FP16: tl.constexpr, SUM: tl.constexpr, ASM: tl.constexpr,
                   HIGH: tl.constexpr):  # fmt: skip
    """The slots' activation pairs ``[S, 4]`` as int16 pairs (``xh0``, ``xh1`` only with ``HIGH``, the 4-bit
    codes' high columns; else returned as they came), the float32 value of a unit of their integer sums ``[S]``
    (16 x the dot product for 4-bit codes, the dot product for 8-bit ones), and (with ``SUM``) the slots'
    activation sums ``[S]``."""
    a0, b0 = _halves(xl0, FP16)
    a1, b1 = _halves(xl1, FP16)
    big = _nan_max(_nan_max(tl.abs(a0), tl.abs(b0)), _nan_max(tl.abs(a1), tl.abs(b1)))
    if HIGH:
        a2, b2 = _halves(xh0, FP16)
        a3, b3 = _halves(xh1, FP16)
        big = _nan_max(big, _nan_max(_nan_max(tl.abs(a2), tl.abs(b2)), _nan_max(tl.abs(a3), tl.abs(b3))))
    # the largest magnitude is below 2**(e - 126): times 2**(141 - e) it is below 2**15, and a 16-bit float there
    # is an integer already (8 or 11 significant bits), so none rounds up to 2**15 (e at least 19 keeps both
    # powers of two normal floats)
    top = _largest_of_four(big).to(tl.int32, bitcast=True) >> 23
    e = tl.minimum(tl.maximum(top, 19), 254)
    inv = ((268 - e) << 23).to(tl.float32, bitcast=True)[:, None]
    # 2**(e - 141), over 16 for the 4-bit codes' sums; a slot holding an infinity or a NaN makes its share NaN
    unit = ((e - (18 if HIGH else 14)) << 23).to(tl.float32, bitcast=True)
    unit = tl.where(top == 255, float("nan"), unit)
    total = unit
    if SUM:
        both = (a0 + b0) + (a1 + b1)
        if HIGH:
            both += (a2 + b2) + (a3 + b3)
        total = tl.sum(both, axis=1)
    pl0, pl1 = _as_int16(a0, b0, inv, ASM), _as_int16(a1, b1, inv, ASM)
    if HIGH:
        return pl0, pl1, _as_int16(a2, b2, inv, ASM), _as_int16(a3, b3, inv, ASM), unit, total
    return pl0, pl1, xh0, xh1, unit, total


@triton.jit
def _slot_words(w32, rows, stride_w, s0, S: tl.constexpr, NUM_SLOTS: tl.constexpr, EVEN: tl.constexpr):
    """The rows' words ``[R, S, 4]`` of slots ``s0 ..``."""
    R: tl.constexpr = rows.shape[0]
    # one flat run of 4 S words a row: each thread its slot's four (a [R, S, 4] load spreads rows over threads)
    words_at = rows[:, None] * stride_w + 4 * s0 + tl.arange(0, 4 * S)[None, :]
    if EVEN:
        return tl.reshape(tl.load(w32 + words_at), (R, S, 4))
    fine = (4 * s0 + tl.arange(0, 4 * S) < 4 * NUM_SLOTS)[None, :]
    return tl.reshape(tl.load(w32 + words_at, mask=fine, other=0), (R, S, 4))


@triton.jit
def _param_offsets(rows, stride_sn, slots, BLOCK: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr):
    """The flat offsets ``[R, S]`` of the rows' group parameters for slots ``slots``."""
    SPB: tl.constexpr = BLOCK // 32
    if BITS == 4:
        group = (slots // SPB) * BLOCK // GROUP
    else:
        group = slots * 16 // GROUP
    return rows[:, None] * stride_sn + group[None, :]


@triton.jit
def _slot_params(scale_ptr, zs_ptr, rows, stride_sn, s0, S: tl.constexpr, NUM_SLOTS: tl.constexpr,
                 BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_ZS: tl.constexpr, EVEN: tl.constexpr,
                 BITS: tl.constexpr, super_ptr, zsuper_ptr, SUB_GROUPS: tl.constexpr):  # fmt: skip
    """The group scales (and zero scales) ``[R, S]`` of the rows' slots ``s0 ..`` in float32."""
    slots = s0 + tl.arange(0, S)
    params = _param_offsets(rows, stride_sn, slots, BLOCK, GROUP, BITS)
    if EVEN:
        scale = group_params(scale_ptr, super_ptr, params, SUB_GROUPS)
        zs = scale
        if HAS_ZS:
            zs = group_params(zs_ptr, zsuper_ptr, params, SUB_GROUPS)
    else:
        ok = (slots < NUM_SLOTS)[None, :]
        scale = group_params_masked(scale_ptr, super_ptr, params, ok, SUB_GROUPS)
        zs = scale
        if HAS_ZS:
            zs = group_params_masked(zs_ptr, zsuper_ptr, params, ok, SUB_GROUPS)
    return scale, zs


@triton.jit
def _prefetch_params(scale_ptr, zs_ptr, rows, stride_sn, S: tl.constexpr, NUM_SLOTS: tl.constexpr,
                     BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_ZS: tl.constexpr, BITS: tl.constexpr,
                     super_ptr, zsuper_ptr, SUB_GROUPS: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """Ask the L2 cache for the lines of the first step's group parameters (:func:`_slot_params`' reads), holding
    no registers for them."""
    slots = tl.arange(0, S)
    params = _param_offsets(rows, stride_sn, slots, BLOCK, GROUP, BITS)
    ok = (slots < NUM_SLOTS)[None, :]
    prefetch_l2(scale_ptr + params, ok, ASM)
    if HAS_ZS:
        prefetch_l2(zs_ptr + params, ok, ASM)
    if SUB_GROUPS != 0:
        prefetch_l2(super_ptr + params // SUB_GROUPS, ok, ASM)
        if HAS_ZS:
            prefetch_l2(zsuper_ptr + params // SUB_GROUPS, ok, ASM)


@triton.jit
def _slot_tiles(w32, scale_ptr, zs_ptr, rows, stride_w, stride_sn, s0, S: tl.constexpr, NUM_SLOTS: tl.constexpr,
                BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_ZS: tl.constexpr, EVEN: tl.constexpr,
                BITS: tl.constexpr, super_ptr, zsuper_ptr, SUB_GROUPS: tl.constexpr):  # fmt: skip
    """The rows' words ``[R, S, 4]`` of slots ``s0 ..`` and their group scales (and zero scales) ``[R, S]`` in
    float32."""
    words = _slot_words(w32, rows, stride_w, s0, S, NUM_SLOTS, EVEN)
    scale, zs = _slot_params(scale_ptr, zs_ptr, rows, stride_sn, s0, S, NUM_SLOTS, BLOCK, GROUP, HAS_ZS, EVEN, BITS,
                             super_ptr, zsuper_ptr, SUB_GROUPS)  # fmt: skip
    return words, scale, zs


@triton.jit
def _slot_activations(x_ptr, perm_ptr, s0, S: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_PERM: tl.constexpr, EVEN: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """Slots ``s0 ..``'s 16-bit activations as pairs ``[S, 4]``: the low columns' two runs of eight and (4-bit codes)
    the high columns' (8-bit codes: the low ones again)."""
    SPB: tl.constexpr = BLOCK // 32
    slots = s0 + tl.arange(0, S)
    ok = slots < NUM_SLOTS
    if BITS == 4:
        cols = (slots // SPB) * BLOCK + (slots % SPB) * 16
    else:
        cols = slots * 16
    xl0 = _pairs(x_ptr, perm_ptr, cols, ok, HAS_PERM, EVEN)
    xl1 = _pairs(x_ptr, perm_ptr, cols + 8, ok, HAS_PERM, EVEN)
    xh0, xh1 = xl0, xl1
    if BITS == 4:
        xh0 = _pairs(x_ptr, perm_ptr, cols + BLOCK // 2, ok, HAS_PERM, EVEN)
        xh1 = _pairs(x_ptr, perm_ptr, cols + BLOCK // 2 + 8, ok, HAS_PERM, EVEN)
    return xl0, xl1, xh0, xh1


@triton.jit
def _step(acc, words, scale, zs, xl0, xl1, xh0, xh1, ZERO: tl.constexpr, HAS_ZS: tl.constexpr, FP16: tl.constexpr,
          ASM: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """``acc [R, S]`` plus the rows' products over one step's slots (:func:`_slot_activations`' pairs), the
    activations converted once."""
    pl0, pl1, ph0, ph1, unit, x_sum = _integer_pairs(xl0, xl1, xh0, xh1, FP16, HAS_ZS or ZERO != 0, ASM, BITS == 4)
    part = _slot_dots(words, pl0, pl1, ph0, ph1, ASM, BITS).to(tl.float32) * unit[None, :]
    if HAS_ZS:
        return acc + part * scale - zs * x_sum[None, :]
    elif ZERO != 0:
        return acc + (part - ZERO * x_sum[None, :]) * scale
    else:
        return acc + part * scale


@triton.jit
def grouped_int_dot_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr,
    N, stride_wn, stride_sn,
    NUM_SLOTS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, WARPS: tl.constexpr,
    FP16: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, GATED: tl.constexpr = -1, BITS: tl.constexpr = 4,
    AHEAD: tl.constexpr = False, super_ptr=None, zsuper_ptr=None, SUB_GROUPS: tl.constexpr = 0,
    EARLY_PARAMS: tl.constexpr = True, PREFETCH_PARAMS: tl.constexpr = False,
):  # fmt: skip
    """``out[n] = sum_k x[perm[k]] * W[n, k] (+ bias[n])`` for ``ROWS`` output features ``n``; or, with ``GATED``
    (an activation of :func:`.elementwise_kernels.gated_product`; ``ROWS`` even, no bias), ``act(gate[f]) * up[f]``
    for ``ROWS / 2`` features ``f`` of a weight stacking the gate's rows over the up rows (``out``: ``N / 2``).

    ``x``: ``[K]`` bf16 (fp16 with ``FP16``), 4-byte aligned; ``w``, ``scale``, ``zs``, ``perm``, ``bias`` as for
    :func:`~.grouped_int_kernels.grouped_int_gemv_kernel` with ``BITS``-bit codes (4-bit ones in blocks of
    ``BLOCK``, a multiple of 32, columns; 8-bit ones in groups of a multiple of 16), ``stride_wn`` (bytes) a
    multiple of 16; ``NUM_SLOTS`` is ``K / 32`` (``K / 16`` for 8-bit codes); ``WARPS`` the launch's
    ``num_warps`` (each step takes ``32 * WARPS`` slots of every row). ``AHEAD``: a reduction of several steps
    reads each step's words and activations before the step before it multiplies (twice the words in flight,
    for as many registers). Under PDL the first step's words are read before the wait, and with
    ``EARLY_PARAMS`` their group parameters too (else after it, their L2 lines asked for before it with
    ``PREFETCH_PARAMS``): what is read before the wait holds its registers across it.
    """
    tl.static_assert(BITS == 8 or BLOCK % 32 == 0, "the slots are 32 columns of a block")
    tl.static_assert(BITS == 4 or GROUP % 16 == 0, "the slots are 16 columns of a group")
    tl.static_assert(GATED == _NOT_GATED or (ROWS % 2 == 0 and not HAS_BIAS), "a gated GEMV runs even rows, no bias")
    S: tl.constexpr = 32 * WARPS
    EVEN: tl.constexpr = NUM_SLOTS % S == 0
    rows, first = _program_rows(N, ROWS, GATED)
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    stride_w = stride_wn // 4
    acc = tl.zeros((ROWS, S), dtype=tl.float32)
    if USE_PDL:
        gdc_launch_dependents()
    # the weight is constant: its first words (and, with EARLY_PARAMS, their scales) are read while the kernel
    # that writes x drains; what is read before the wait stays live across it, in registers
    words = _slot_words(w32, rows, stride_w, 0, S, NUM_SLOTS, EVEN)
    if EARLY_PARAMS:
        scale, zs = _slot_params(scale_ptr, zs_ptr, rows, stride_sn, 0, S, NUM_SLOTS, BLOCK, GROUP, HAS_ZS, EVEN, BITS,
                                 super_ptr, zsuper_ptr, SUB_GROUPS)  # fmt: skip
    elif PREFETCH_PARAMS:
        _prefetch_params(scale_ptr, zs_ptr, rows, stride_sn, S, NUM_SLOTS, BLOCK, GROUP, HAS_ZS, BITS, super_ptr,
                         zsuper_ptr, SUB_GROUPS, ASM)  # fmt: skip
    if USE_PDL:
        gdc_wait()
    if not EARLY_PARAMS:
        scale, zs = _slot_params(scale_ptr, zs_ptr, rows, stride_sn, 0, S, NUM_SLOTS, BLOCK, GROUP, HAS_ZS, EVEN, BITS,
                                 super_ptr, zsuper_ptr, SUB_GROUPS)  # fmt: skip
    xl0, xl1, xh0, xh1 = _slot_activations(x_ptr, perm_ptr, 0, S, NUM_SLOTS, BLOCK, HAS_PERM, EVEN, BITS)
    if AHEAD and NUM_SLOTS > S:
        for s0 in tl.range(0, NUM_SLOTS, S):
            # the next step's words and activations are read before this step multiplies, so neither's latency
            # follows the arithmetic (the last step reads its own again, unused; masked past the end where the
            # steps do not fit)
            ahead = tl.minimum(s0 + S, NUM_SLOTS - S) if EVEN else s0 + S
            next_words, next_scale, next_zs = _slot_tiles(w32, scale_ptr, zs_ptr, rows, stride_w, stride_sn, ahead, S,
                                                          NUM_SLOTS, BLOCK, GROUP, HAS_ZS, EVEN, BITS, super_ptr,
                                                          zsuper_ptr, SUB_GROUPS)  # fmt: skip
            nl0, nl1, nh0, nh1 = _slot_activations(x_ptr, perm_ptr, ahead, S, NUM_SLOTS, BLOCK, HAS_PERM, EVEN, BITS)
            acc = _step(acc, words, scale, zs, xl0, xl1, xh0, xh1, ZERO, HAS_ZS, FP16, ASM, BITS)
            words, scale, zs = next_words, next_scale, next_zs
            xl0, xl1, xh0, xh1 = nl0, nl1, nh0, nh1
    else:
        acc = _step(acc, words, scale, zs, xl0, xl1, xh0, xh1, ZERO, HAS_ZS, FP16, ASM, BITS)
        for s0 in tl.range(S, NUM_SLOTS, S):
            words, scale, zs = _slot_tiles(w32, scale_ptr, zs_ptr, rows, stride_w, stride_sn, s0, S, NUM_SLOTS,
                                           BLOCK, GROUP, HAS_ZS, EVEN, BITS, super_ptr, zsuper_ptr, SUB_GROUPS)  # fmt: skip
            xl0, xl1, xh0, xh1 = _slot_activations(x_ptr, perm_ptr, s0, S, NUM_SLOTS, BLOCK, HAS_PERM, EVEN, BITS)
            acc = _step(acc, words, scale, zs, xl0, xl1, xh0, xh1, ZERO, HAS_ZS, FP16, ASM, BITS)
    _store(out_ptr, bias_ptr, first, N, tl.sum(acc, axis=1), ROWS, HAS_BIAS, GATED)

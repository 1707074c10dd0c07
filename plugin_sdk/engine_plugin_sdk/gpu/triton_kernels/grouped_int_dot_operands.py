"""What a program of the integer-dot GEMV (:mod:`.grouped_int_dot_gemv_kernels`) reads and writes: its rows and
outputs, a step's code words and group parameters, its 16-bit activations as pairs, and their conversion to int16
pairs under a power of two a slot (the precision argument is the kernel module's)."""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import gated_product
from engine_plugin_sdk.gpu.triton_kernels.grouped_int4_fragment_mma import _halves
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_gemv_rows import _NOT_GATED
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_params import group_params, group_params_masked

#: 1.5 * 2**23: added to a float below 2**22 in magnitude it leaves the rounded integer in the low mantissa bits
_ROUNDING = tl.constexpr(12582912.0)


@triton.jit
def _pairs(x_ptr, perm_ptr, cols, ok, HAS_PERM: tl.constexpr, EVEN: tl.constexpr, VECTOR_MASKS: tl.constexpr = False):
    """int32 ``[S, 4]``: the 16-bit activations of columns ``cols + 2j`` (low half) and ``cols + 2j + 1`` (high),
    read as one flat run of ``4 S`` (so that a thread holds its slot's four, as it holds its words). ``VECTOR_MASKS``:
    a masked run tells the compiler that a slot's four words are in or out together, so that the load stays one
    16-byte vector (else four 4-byte loads: down_proj's 448 slots of Llama-3-8B, 32 a step in sm_90 code)."""
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
        elif VECTOR_MASKS:
            pairs = tl.load(ptrs, mask=tl.max_constancy(fine, 4), other=0)
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
                   HIGH: tl.constexpr, SIX: tl.constexpr = False):  # fmt: skip
    """The slots' activation pairs ``[S, 4]`` as int16 pairs (``xh0``, ``xh1`` only with ``HIGH``, the 4-bit
    codes' high columns; else returned as they came), the float32 value of a unit of their integer sums ``[S]``
    (16 x the dot product for 4-bit codes, the dot product for 8-bit ones and, with ``SIX``, for 6-bit ones, whose
    high columns are ``HIGH``'s too), and (with ``SUM``) the slots' activation sums ``[S]`` twice, or with ``SIX``
    those of the low and the high columns."""
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
    unit = ((e - (18 if HIGH and not SIX else 14)) << 23).to(tl.float32, bitcast=True)
    unit = tl.where(top == 255, float("nan"), unit)
    total, total_high = unit, unit
    if SUM:
        both = (a0 + b0) + (a1 + b1)
        if SIX:
            total = tl.sum(both, axis=1)
            total_high = tl.sum((a2 + b2) + (a3 + b3), axis=1)
        else:
            if HIGH:
                both += (a2 + b2) + (a3 + b3)
            total = tl.sum(both, axis=1)
            total_high = total
    pl0, pl1 = _as_int16(a0, b0, inv, ASM), _as_int16(a1, b1, inv, ASM)
    if HIGH:
        return pl0, pl1, _as_int16(a2, b2, inv, ASM), _as_int16(a3, b3, inv, ASM), unit, total, total_high
    return pl0, pl1, xh0, xh1, unit, total, total_high


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
def slot_columns(slots, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """The first column of each slot's low run (4-bit codes: its block's low half; 8-bit codes: 16 in a row)."""
    if BITS != 8:
        SPB: tl.constexpr = BLOCK // 32
        return (slots // SPB) * BLOCK + (slots % SPB) * 16
    return slots * 16


@triton.jit
def _slot_activations(x_ptr, perm_ptr, s0, S: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_PERM: tl.constexpr, EVEN: tl.constexpr, BITS: tl.constexpr,
                      VECTOR_MASKS: tl.constexpr = False):  # fmt: skip
    """Slots ``s0 ..``'s 16-bit activations as pairs ``[S, 4]``: the low columns' two runs of eight and (4-bit codes)
    the high columns' (8-bit codes: the low ones again)."""
    slots = s0 + tl.arange(0, S)
    ok = slots < NUM_SLOTS
    cols = slot_columns(slots, BLOCK, BITS)
    xl0 = _pairs(x_ptr, perm_ptr, cols, ok, HAS_PERM, EVEN, VECTOR_MASKS)
    xl1 = _pairs(x_ptr, perm_ptr, cols + 8, ok, HAS_PERM, EVEN, VECTOR_MASKS)
    xh0, xh1 = xl0, xl1
    if BITS != 8:
        xh0 = _pairs(x_ptr, perm_ptr, cols + BLOCK // 2, ok, HAS_PERM, EVEN, VECTOR_MASKS)
        xh1 = _pairs(x_ptr, perm_ptr, cols + BLOCK // 2 + 8, ok, HAS_PERM, EVEN, VECTOR_MASKS)
    return xl0, xl1, xh0, xh1


@triton.jit
def x_row(X_ROWS: tl.constexpr):
    """The activation row of the program (0 with one row): the programs of one group of weight rows are adjacent
    launch ids, one an activation row, so that they run together and all but the first find the weight's lines in
    the L2 cache (a row a program would read the weight once a row from memory)."""
    return tl.program_id(0) % X_ROWS


@triton.jit
def _program_rows(N, ROWS: tl.constexpr, GATED: tl.constexpr, group=0, GROUPS: tl.constexpr = 1,
                  X_ROWS: tl.constexpr = 1):  # fmt: skip
    """The program's weight rows ``[ROWS]`` (past ``N`` the last again, never stored) and its first output feature:
    ``ROWS`` consecutive rows, or with ``GATED`` the gate rows of ``ROWS / 2`` features then their up rows; a
    program of ``GROUPS`` row groups takes its ``group``-th. With ``X_ROWS`` activation rows the program ids run
    over them fastest (:func:`x_row`), ``X_ROWS`` programs a group of weight rows."""
    program = tl.program_id(0) // X_ROWS
    if GATED == _NOT_GATED:
        first = (program * GROUPS + group) * ROWS
        return tl.minimum(first + tl.arange(0, ROWS), N - 1).to(tl.int64), first
    else:
        F: tl.constexpr = ROWS // 2
        first = (program * GROUPS + group) * F
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
def _param_offsets(rows, stride_sn, slots, BLOCK: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
                   PARAM_ROWS: tl.constexpr = 0):  # fmt: skip
    """The flat offsets ``[R, S]`` of the rows' group parameters for slots ``slots``: row-major ``[out, groups]``
    (``stride_sn`` a row), or with ``PARAM_ROWS`` (``R``) a program-order copy's, ``stride_sn`` a program
    (:mod:`.grouped_int_program_params`: a thread's ``R`` rows of a group are one vector load)."""
    SPB: tl.constexpr = BLOCK // 32
    if BITS == 4:
        group = (slots // SPB) * BLOCK // GROUP
    else:
        group = slots * 16 // GROUP
    if PARAM_ROWS != 0:
        tl.static_assert(PARAM_ROWS == rows.shape[0], "a program-order copy holds the program's rows")
        at = tl.program_id(0).to(tl.int64) * stride_sn + group[None, :] * PARAM_ROWS + tl.arange(0, PARAM_ROWS)[:, None]
    else:
        at = rows[:, None] * stride_sn + group[None, :]
    return at


@triton.jit
def _params_at(scale_ptr, zs_ptr, params, slots, NUM_SLOTS: tl.constexpr, HAS_ZS: tl.constexpr, EVEN: tl.constexpr,
               super_ptr, zsuper_ptr, SUB_GROUPS: tl.constexpr, PARAM_ROWS: tl.constexpr = 0):  # fmt: skip
    """The group scales (and zero scales) at flat offsets ``params [R, S]`` of slots ``slots`` in float32."""
    if EVEN:
        scale = group_params(scale_ptr, super_ptr, params, SUB_GROUPS, PARAM_ROWS)
        zs = scale
        if HAS_ZS:
            zs = group_params(zs_ptr, zsuper_ptr, params, SUB_GROUPS, PARAM_ROWS)
    else:
        ok = (slots < NUM_SLOTS)[None, :]
        scale = group_params_masked(scale_ptr, super_ptr, params, ok, SUB_GROUPS, PARAM_ROWS)
        zs = scale
        if HAS_ZS:
            zs = group_params_masked(zs_ptr, zsuper_ptr, params, ok, SUB_GROUPS, PARAM_ROWS)
    return scale, zs


@triton.jit
def _slot_params(scale_ptr, zs_ptr, rows, stride_sn, s0, S: tl.constexpr, NUM_SLOTS: tl.constexpr,
                 BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_ZS: tl.constexpr, EVEN: tl.constexpr,
                 BITS: tl.constexpr, super_ptr, zsuper_ptr, SUB_GROUPS: tl.constexpr,
                 PARAM_ROWS: tl.constexpr = 0):  # fmt: skip
    """The group scales (and zero scales) ``[R, S]`` of the rows' slots ``s0 ..`` in float32."""
    slots = s0 + tl.arange(0, S)
    params = _param_offsets(rows, stride_sn, slots, BLOCK, GROUP, BITS, PARAM_ROWS)
    return _params_at(scale_ptr, zs_ptr, params, slots, NUM_SLOTS, HAS_ZS, EVEN, super_ptr, zsuper_ptr, SUB_GROUPS,
                      PARAM_ROWS)  # fmt: skip

"""A layer's residual add and RMS norm that hands the next integer-dot GEMV its row already converted
(``dot_gemv_prepared``, ``PREPARED`` in :mod:`.grouped_int_dot_gemv_kernels`): ``s = x + residual`` and ``y =
rms_norm(s) * w`` as the norm kernel computes them (:func:`.elementwise_kernels.summed_row_rms` over the same
flat layout, so the same sum of squares), then ``y`` as every program of that GEMV would convert it
(:func:`.grouped_int_dot_operands._integer_pairs`): each slot's activations as int16 under its power of two, the
float32 value of a unit of their integer sums, and their sum.

Why: the GEMV converts the row in each of its programs, some 175 of a W4A16 program's 560 instructions a thread
(sm_90 code, 8 rows, 4 warps) for 16 KB of codes; at the H200's bandwidth the products issue near the rate an SM
sustains. One program here converts the row once for all of them, in the launch the norm takes anyway. Its
columns lie flat over the norm kernel's warps (8 a thread for a 4,096-wide row), each slot's largest magnitude and
sum reduced across the threads that hold it: a first version gave each thread a whole slot (32 columns of 4-bit
codes, 4 warps) and took 2.51 us on an H100 where the norm kernel takes 2.05.

Layout: ``xq`` holds the int16 activations at their columns (``[K]``, read by the GEMV exactly as it reads the
16-bit row), ``unit`` and ``total`` one float32 a slot (``K / 32`` slots of the weight's blocks for 4-bit codes:
a block's 16-column runs ``j`` of its low half and ``j`` of its high half; ``K / 16`` runs of 16 columns for 8-bit
codes), so a row prepared for one block width serves only products of it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import summed_row_rms
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_operands import _ROUNDING, _nan_max
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _by_slot(t, COLS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """A ``[COLS]`` tensor as ``[slots, 2, runs, 16]``: slot ``b * runs + j`` holds column ``b * BLOCK + h * BLOCK / 2
    + j * 16 + c`` at ``[b, h, j, c]`` (4-bit codes); 8-bit codes' slots are runs of 16 (``h`` and ``j`` one wide)."""
    SPAN: tl.constexpr = 16 if BITS == 8 else BLOCK
    HALVES: tl.constexpr = 1 if BITS == 8 else 2
    return tl.reshape(t, (COLS // SPAN, HALVES, SPAN // 16 // HALVES, 16))


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _slot_max(t):
    """``[blocks, 2, runs, 16]``'s largest of each slot (NaN if any is), ``[blocks * runs]`` in slot order."""
    per_run = tl.reduce(tl.reduce(t, 3, _nan_max), 1, _nan_max)
    return tl.reshape(per_run, (t.shape[0] * t.shape[2],))


@triton.jit
def _slot_sum(t):
    """``[blocks, 2, runs, 16]``'s sum of each slot, ``[blocks * runs]`` in slot order."""
    per_run = tl.reduce(tl.reduce(t, 3, _add), 1, _add)
    return tl.reshape(per_run, (t.shape[0] * t.shape[2],))


@triton.jit
def add_rms_norm_prepared_kernel(
    x_ptr, res_ptr, nw_ptr, res_out_ptr, xq_ptr, unit_ptr, total_ptr, eps,
    HIDDEN: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One program: ``res_out = x + residual`` (rounded to the 16-bit dtype), and the normalised row's slots for the
    integer-dot GEMV over ``BITS``-bit codes in blocks of ``BLOCK`` columns: ``xq`` (int16 ``[HIDDEN]``) their
    activations, ``unit`` / ``total`` (float32, a slot) a unit of their integer sums and their sum. ``x``, ``res``,
    ``nw`` (the norm's scales) ``[HIDDEN]`` 16-bit; ``COLS`` the power of two at or above ``HIDDEN`` (a multiple of
    ``BLOCK``, a power of two, for 4-bit codes)."""
    tl.static_assert(BITS == 4 or BITS == 8, "4- or 8-bit codes' slots")
    tl.static_assert(BITS == 8 or COLS % BLOCK == 0, "whole blocks")
    if USE_PDL:
        gdc_launch_dependents()
    cols = tl.arange(0, COLS)
    ok = cols < HIDDEN
    # the norm's scales are constant: read while the kernel that writes x drains
    w = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_wait()
    s, inv = summed_row_rms(res_out_ptr, x_ptr, res_ptr, eps, 0, cols, ok, ok, 0, 0, 0, HIDDEN)
    y = (s * inv * w).to(res_out_ptr.dtype.element_ty).to(tl.float32)
    by_slot = _by_slot(y, COLS, BLOCK, BITS)
    # each slot's largest magnitude: below 2**(e - 126), so times 2**(141 - e) below 2**15, where a 16-bit float
    # is an integer already and none rounds up to 2**15 (e at least 19 keeps both powers of two normal floats)
    big = _slot_max(tl.abs(by_slot))
    top = big.to(tl.int32, bitcast=True) >> 23
    e = tl.minimum(tl.maximum(top, 19), 254)
    # 2**(e - 141), over 16 for the 4-bit codes' sums; a slot holding an infinity or a NaN makes its share NaN
    unit = ((e - (18 if BITS == 4 else 14)) << 23).to(tl.float32, bitcast=True)
    unit = tl.where(top == 255, float("nan"), unit)
    total = _slot_sum(by_slot)
    slots = tl.arange(0, big.shape[0])
    num_slots: tl.constexpr = HIDDEN // (16 if BITS == 8 else 32)
    tl.store(unit_ptr + slots, unit, mask=slots < num_slots)
    tl.store(total_ptr + slots, total, mask=slots < num_slots)
    # back to the columns: each slot's 2**(141 - e) beside its activations
    scale = ((268 - e) << 23).to(tl.float32, bitcast=True)
    scaled = tl.reshape(by_slot * tl.reshape(scale, (by_slot.shape[0], 1, by_slot.shape[2], 1)), (COLS,))
    q = (scaled + _ROUNDING).to(tl.int32, bitcast=True).to(tl.int16)
    tl.store(xq_ptr + cols, q, mask=ok)

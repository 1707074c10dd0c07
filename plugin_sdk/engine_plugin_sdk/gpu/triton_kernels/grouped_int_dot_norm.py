"""The integer-dot GEMV's activations as the residual add and RMS norm before it would have written them
(``NORM`` in :mod:`.grouped_int_dot_gemv_kernels`): ``s = x + residual`` rounded to the activations' dtype,
``y = s / sqrt(mean(s^2) + eps) * w`` rounded again, in the op table's ``fused_add_rms_norm`` arithmetic.

Why: at batch 1 the norm is a launch of one program between two products, and what it costs is its latency and
the next product's wait for it, not its 16 KB. A single-step GEMV's program holds a slot of every column of the
row (its ``32 * WARPS`` slots are the whole reduction), so it can sum the row and its squares itself: two
16-bit loads and a block-wide sum where it read one row. Every program computes the same ``s`` (the same
operations on the same values); the first stores it as the new residual stream.

The pairs are the ones :func:`.grouped_int_dot_operands._slot_activations` reads (the low columns' two runs of
eight pairs a slot, and for 4-bit codes the high columns' two), as 32-bit words of two 16-bit floats, so the
program's conversion to integers takes them unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.grouped_int4_fragment_mma import _halves
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_operands import (
    _pairs,
    _slot_activations,
    slot_columns,
)


@triton.jit
def _packed(lo, hi, FP16: tl.constexpr):
    """int32 words of two 16-bit floats: ``lo`` (float32, rounded) in the low half, ``hi`` in the high."""
    if FP16:
        a = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        b = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    else:
        a = lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
        b = hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    return (a & 0xFFFF) | (b << 16)


@triton.jit
def norm_scales(nw_ptr, S: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """The norm's scales as pairs ``[S, 4]`` x 2 (x 4 for 4-bit codes) in the runs' order (0 past ``NUM_SLOTS``),
    read as the activations are: constant, so read before the PDL wait."""
    return _slot_activations(nw_ptr, nw_ptr, 0, S, NUM_SLOTS, BLOCK, False, NUM_SLOTS == S, BITS)


@triton.jit
def _summed_run(x_ptr, res_ptr, cols, ok, FP16: tl.constexpr, EVEN: tl.constexpr):
    """One run of pairs of ``s = x + residual`` rounded to the 16-bit dtype, as words ``[S, 4]`` (0 where not
    ``ok``; kept packed, half the registers of their floats), and their squares' sums ``[S, 4]``."""
    xa, xb = _halves(_pairs(x_ptr, x_ptr, cols, ok, False, EVEN), FP16)
    ra, rb = _halves(_pairs(res_ptr, res_ptr, cols, ok, False, EVEN), FP16)
    words = _packed(xa + ra, xb + rb, FP16)
    sa, sb = _halves(words, FP16)
    return words, sa * sa + sb * sb


@triton.jit
def _normed_run(words, wpairs, inv, FP16: tl.constexpr):
    """A run's normalised activations as pair words: ``(s * inv) * w`` rounded, as the norm kernel computes it."""
    sa, sb = _halves(words, FP16)
    wa, wb = _halves(wpairs, FP16)
    return _packed((sa * inv) * wa, (sb * inv) * wb, FP16)


@triton.jit
def normed_activations(x_ptr, res_ptr, res_out_ptr, eps, wl0, wl1, wh0, wh1, S: tl.constexpr,
                       NUM_SLOTS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                       FP16: tl.constexpr):  # fmt: skip
    """The slots' activation pairs ``[S, 4]`` (low runs, then high; 8-bit codes: the low ones twice) of the
    normalised ``x + residual`` over a single-step row of ``NUM_SLOTS`` (at most ``S``) slots, ``wl0 ..`` the
    norm's scales (:func:`norm_scales`). Program 0 stores the sum as the new residual stream."""
    EVEN: tl.constexpr = NUM_SLOTS == S
    HIDDEN: tl.constexpr = NUM_SLOTS * (16 if BITS == 8 else 32)
    cols = slot_columns(tl.arange(0, S), BLOCK, BITS)
    ok = tl.arange(0, S) < NUM_SLOTS
    s0, q0 = _summed_run(x_ptr, res_ptr, cols, ok, FP16, EVEN)
    s1, q1 = _summed_run(x_ptr, res_ptr, cols + 8, ok, FP16, EVEN)
    squares = q0 + q1
    s2, s3 = s0, s1
    if BITS != 8:
        s2, q2 = _summed_run(x_ptr, res_ptr, cols + BLOCK // 2, ok, FP16, EVEN)
        s3, q3 = _summed_run(x_ptr, res_ptr, cols + BLOCK // 2 + 8, ok, FP16, EVEN)
        squares += q2 + q3
    if tl.program_id(0) == 0:
        # the first program stores the sum (a branch every thread of a program takes alike)
        _store_sums(res_out_ptr, cols, ok, s0, s1)
        if BITS != 8:
            _store_sums(res_out_ptr, cols + BLOCK // 2, ok, s2, s3)
    inv = 1.0 / tl.sqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / HIDDEN + eps)
    xl0 = _normed_run(s0, wl0, inv, FP16)
    xl1 = _normed_run(s1, wl1, inv, FP16)
    if BITS != 8:
        return xl0, xl1, _normed_run(s2, wh0, inv, FP16), _normed_run(s3, wh1, inv, FP16)
    return xl0, xl1, xl0, xl1


@triton.jit
def _store_sums(res_out_ptr, cols, ok, s0, s1):
    """Store two runs of sums' words ``[S, 4]`` of the slots ``ok``: ``cols``' run and the one 8 columns on."""
    at = (cols[:, None] + 2 * tl.arange(0, 4)[None, :]) // 2
    fine = tl.broadcast_to(ok[:, None], at.shape)
    words = res_out_ptr.to(tl.pointer_type(tl.int32))
    tl.store(words + tl.max_contiguous(tl.multiple_of(at, [1, 4]), [1, 4]), s0, mask=fine)
    tl.store(words + tl.max_contiguous(tl.multiple_of(at + 4, [1, 4]), [1, 4]), s1, mask=fine)

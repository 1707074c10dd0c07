"""A layer's residual add and RMS norm that hands the next integer-dot GEMV its row already converted
(``dot_gemv_prepared``, ``PREPARED`` in :mod:`.grouped_int_dot_gemv_kernels`): ``s = x + residual`` and ``y =
rms_norm(s) * w`` in the op table's ``fused_add_rms_norm`` arithmetic (:mod:`.grouped_int_dot_norm`), then ``y``
as every program of that GEMV would convert it (:func:`.grouped_int_dot_operands._integer_pairs`): each slot's
activations as int16 under its power of two, the float32 value of a unit of their integer sums, and their sum.

Why: the GEMV converts the row in each of its programs, some 175 of a W4A16 program's 560 instructions a thread
(sm_90 code, 8 rows, 4 warps) for 16 KB of codes; at the H200's bandwidth the products issue near the rate an SM
sustains. One program here converts the row once for all of them, in the launch the norm takes anyway.

Layout: ``xq`` holds the int16 activations at their columns (``[K]``, read by the GEMV exactly as it reads the
16-bit row), ``unit`` and ``total`` one float32 a slot (``K / 32`` slots of the weight's blocks for 4-bit codes,
``K / 16`` runs of 16 columns for 8-bit ones), so a row prepared for one block width serves only products of it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_norm import (
    _store_sums,
    norm_scales,
    normed_activations,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_operands import _integer_pairs, slot_columns
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def add_rms_norm_prepared_kernel(
    x_ptr, res_ptr, nw_ptr, res_out_ptr, xq_ptr, unit_ptr, total_ptr, eps,
    NUM_SLOTS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, WARPS: tl.constexpr, FP16: tl.constexpr,
    ASM: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One program: ``res_out = x + residual`` (rounded to the 16-bit dtype), and the normalised row's slots for
    the integer-dot GEMV over ``BITS``-bit codes in blocks of ``BLOCK`` columns: ``xq`` (int16 ``[K]``) their
    activations, ``unit`` / ``total`` (float32 ``[NUM_SLOTS]``) a unit of their integer sums and their sum.
    ``x``, ``res``, ``nw`` (the norm's scales) ``[K]`` 16-bit, 4-byte aligned; ``NUM_SLOTS`` at most ``32 *
    WARPS`` (the GEMV's single step)."""
    S: tl.constexpr = 32 * WARPS
    tl.static_assert(NUM_SLOTS <= S, "one program's slots take the whole row")
    tl.static_assert(BITS == 4 or BITS == 8, "4- or 8-bit codes' slots")
    if USE_PDL:
        gdc_launch_dependents()
    # the norm's scales are constant: read while the kernel that writes x drains
    wl0, wl1, wh0, wh1 = norm_scales(nw_ptr, S, NUM_SLOTS, BLOCK, BITS)
    if USE_PDL:
        gdc_wait()
    xl0, xl1, xh0, xh1 = normed_activations(x_ptr, res_ptr, res_out_ptr, eps, wl0, wl1, wh0, wh1, S, NUM_SLOTS, BLOCK,
                                            BITS, FP16)  # fmt: skip
    pl0, pl1, ph0, ph1, unit, total, _ = _integer_pairs(xl0, xl1, xh0, xh1, FP16, True, ASM, BITS != 8)
    slots = tl.arange(0, S)
    ok = slots < NUM_SLOTS
    cols = slot_columns(slots, BLOCK, BITS)
    _store_sums(xq_ptr, cols, ok, pl0, pl1)
    if BITS != 8:
        _store_sums(xq_ptr, cols + BLOCK // 2, ok, ph0, ph1)
    tl.store(unit_ptr + slots, unit, mask=ok)
    tl.store(total_ptr + slots, total, mask=ok)

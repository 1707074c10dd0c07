"""A grouped-integer weight's per-group parameters (scales, zero scales) as the kernels read them: one float per
group, or, for GGUF's K-quants kept in their own two-level form (``SUB_GROUPS`` groups to a super-block), a small
integer per group times its super-block's fp16 scale, multiplied in float32 (exact: 11 by at most 8 significant
bits), so that a product reads about a byte a group instead of four.

The super-block parameters are laid out ``[out, groups / SUB_GROUPS]`` beside ``[out, groups]`` ones, so a
group's flat offset ``row * groups + g`` divided by ``SUB_GROUPS`` is its super-block's. In a program-order copy
(``PARAM_ROWS`` rows a program, rows fastest: :mod:`.grouped_int_program_params`) a group's offset is
``(program * groups + g) * PARAM_ROWS + i`` and its super-block's ``(program * groups / SUB_GROUPS + g / SUB_GROUPS)
* PARAM_ROWS + i``, from the same quotient and remainder."""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl


def super_args(weight: Any) -> dict:
    """A launch's arguments for a :class:`~engine_plugin_sdk.gpu.gemm.GroupedIntWeight`'s super-block scales: for
    one-level scales any pointer (unread with ``SUB_GROUPS`` 0; always a tensor, so that no launch specializes
    on a missing one)."""
    if not weight.sub_groups:
        return {"super_ptr": weight.scales, "zsuper_ptr": weight.scales, "SUB_GROUPS": 0}
    zsuper = weight.super_zero_scales if weight.super_zero_scales is not None else weight.super_scales
    return {"super_ptr": weight.super_scales, "zsuper_ptr": zsuper, "SUB_GROUPS": weight.sub_groups}


@triton.jit
def params_back(ptr, rows, stride, SUB_GROUPS: tl.constexpr, UNIT: tl.constexpr = 1):
    """``ptr`` set back by ``rows`` of ``stride`` elements (a super-block scale's: ``1 / SUB_GROUPS`` of them), where
    a kernel's program numbers its rows (or programs) otherwise than the parameters' layout does. ``UNIT``: a
    factor of ``stride / SUB_GROUPS`` (a program-order copy's rows a program) kept out of the division, so the
    compiler still knows the pointer's alignment (else a program's vector of super-block scales became scalar
    loads: 650 sm_90 instructions in Q6_K's down_proj loop at 16 rows and two activation rows against 479)."""
    if SUB_GROUPS == 0:
        return ptr - rows * stride
    return ptr - rows * UNIT * (stride // (SUB_GROUPS * UNIT))


@triton.jit
def super_offsets(at, SUB_GROUPS: tl.constexpr, PARAM_ROWS: tl.constexpr):
    """The super-block offsets of the groups at flat offsets ``at`` (row-major, or a program-order copy's)."""
    if PARAM_ROWS == 0:
        return at // SUB_GROUPS
    return (at // (PARAM_ROWS * SUB_GROUPS)) * PARAM_ROWS + at % PARAM_ROWS


@triton.jit
def group_params(p_ptr, super_ptr, at, SUB_GROUPS: tl.constexpr, PARAM_ROWS: tl.constexpr = 0):
    """float32 parameters of the groups at flat offsets ``at`` (any shape)."""
    if SUB_GROUPS == 0:
        return tl.load(p_ptr + at).to(tl.float32)
    one = tl.load(super_ptr + super_offsets(at, SUB_GROUPS, PARAM_ROWS)).to(tl.float32)
    return tl.load(p_ptr + at).to(tl.float32) * one


@triton.jit
def group_params_masked(p_ptr, super_ptr, at, ok, SUB_GROUPS: tl.constexpr, PARAM_ROWS: tl.constexpr = 0):
    """:func:`group_params` where ``ok``, 0 elsewhere."""
    if SUB_GROUPS == 0:
        return tl.load(p_ptr + at, mask=ok, other=0.0).to(tl.float32)
    sub = tl.load(p_ptr + at, mask=ok, other=0).to(tl.float32)
    return sub * tl.load(super_ptr + super_offsets(at, SUB_GROUPS, PARAM_ROWS), mask=ok, other=0.0).to(tl.float32)

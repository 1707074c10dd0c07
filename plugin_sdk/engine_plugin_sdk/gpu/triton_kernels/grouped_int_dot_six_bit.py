"""The integer-dot GEMV's reduction over 6-bit codes (GGUF's Q6_K and the 5- / 3- / 2-bit forms kept as 6-bit codes,
:mod:`.grouped_int_six_bit`): each step reads a slot's code words and its plane words beside them, and each half of
a slot (16 columns) takes its own group's parameters where groups are 16 columns. Called from
:func:`.grouped_int_dot_gemv_kernels.grouped_int_dot_gemv_kernel`, whose docstring gives the arguments."""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_operands import (
    _integer_pairs,
    _params_at,
    _slot_activations,
    _slot_words,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_products import _slot_dots6
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_params import super_offsets
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_six_bit import six_bit_plane_words
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_wait


@triton.jit
def group_at(rows, stride_sn, group, PARAM_ROWS: tl.constexpr):
    """Flat offsets ``[R, S]`` of the rows' groups ``group [S]``: row-major ``[out, groups]``, or with
    ``PARAM_ROWS`` a program-order copy's (``stride_sn`` a program)."""
    if PARAM_ROWS != 0:
        return tl.program_id(0).to(tl.int64) * stride_sn + group[None, :] * PARAM_ROWS + tl.arange(0, PARAM_ROWS)[:, None]
    return rows[:, None] * stride_sn + group[None, :]


@triton.jit
def six_bit_params(scale_ptr, zs_ptr, rows, stride_sn, s0, S: tl.constexpr, NUM_SLOTS: tl.constexpr,
                   GROUP: tl.constexpr, HAS_ZS: tl.constexpr, EVEN: tl.constexpr, super_ptr, zsuper_ptr,
                   SUB_GROUPS: tl.constexpr, PARAM_ROWS: tl.constexpr = 0):  # fmt: skip
    """The group scales and zero scales ``[R, S]`` of the rows' 6-bit slots ``s0 ..``: the low columns', then the
    high columns' (their own group where groups are 16 columns); row-major or, with ``PARAM_ROWS``, from a
    program-order copy."""
    slots = s0 + tl.arange(0, S)
    if GROUP == 16 and not HAS_ZS and SUB_GROUPS != 0:
        # Q6_K's form: a block's two groups side by side under one super-block, whose scale is read once (a load
        # of the pair would be split across threads: a shuffle through shared memory a step)
        low_at = group_at(rows, stride_sn, 2 * slots, PARAM_ROWS)
        high_at = group_at(rows, stride_sn, 2 * slots + 1, PARAM_ROWS)
        one_at = super_offsets(low_at, SUB_GROUPS, PARAM_ROWS)
        if EVEN:
            one = tl.load(super_ptr + one_at).to(tl.float32)
            scale = tl.load(scale_ptr + low_at).to(tl.float32) * one
            scale_hi = tl.load(scale_ptr + high_at).to(tl.float32) * one
        else:
            ok = (slots < NUM_SLOTS)[None, :]
            one = tl.load(super_ptr + one_at, mask=ok, other=0.0).to(tl.float32)
            scale = tl.load(scale_ptr + low_at, mask=ok, other=0).to(tl.float32) * one
            scale_hi = tl.load(scale_ptr + high_at, mask=ok, other=0).to(tl.float32) * one
        return scale, scale, scale_hi, scale_hi
    low = group_at(rows, stride_sn, slots * 32 // GROUP, PARAM_ROWS)
    scale, zs = _params_at(scale_ptr, zs_ptr, low, slots, NUM_SLOTS, HAS_ZS, EVEN, super_ptr, zsuper_ptr, SUB_GROUPS,
                           PARAM_ROWS)  # fmt: skip
    scale_hi, zs_hi = scale, zs
    if GROUP % 32 != 0:
        high = group_at(rows, stride_sn, (slots * 32 + 16) // GROUP, PARAM_ROWS)
        scale_hi, zs_hi = _params_at(scale_ptr, zs_ptr, high, slots, NUM_SLOTS, HAS_ZS, EVEN, super_ptr, zsuper_ptr,
                                     SUB_GROUPS, PARAM_ROWS)  # fmt: skip
    return scale, zs, scale_hi, zs_hi


@triton.jit
def six_bit_step(acc, words, plane, scale, zs, scale_hi, zs_hi, xl0, xl1, xh0, xh1, ZERO: tl.constexpr,
                 HAS_ZS: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """:func:`.grouped_int_dot_gemv_kernels._step` over 6-bit slots: each half of a slot with its own group's parameters."""
    pl0, pl1, ph0, ph1, unit, x_low, x_high = _integer_pairs(xl0, xl1, xh0, xh1, FP16, HAS_ZS or ZERO != 0, ASM,
                                                             True, True)  # fmt: skip
    low, high = _slot_dots6(words, plane, pl0, pl1, ph0, ph1, ASM)
    low = low.to(tl.float32) * unit[None, :]
    high = high.to(tl.float32) * unit[None, :]
    if HAS_ZS:
        return acc + (low * scale - zs * x_low[None, :]) + (high * scale_hi - zs_hi * x_high[None, :])
    elif ZERO != 0:
        return acc + (low - ZERO * x_low[None, :]) * scale + (high - ZERO * x_high[None, :]) * scale_hi
    else:
        return acc + low * scale + high * scale_hi


@triton.jit
def six_bit_sums(x_ptr, w32, p16, scale_ptr, zs_ptr, perm_ptr, rows, stride_w, stride_p, stride_sn,
                 NUM_SLOTS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
                 HAS_PERM: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr,
                 USE_PDL: tl.constexpr, super_ptr, zsuper_ptr, SUB_GROUPS: tl.constexpr,
                 EARLY_PARAMS: tl.constexpr, PARAM_ROWS: tl.constexpr = 0,
                 VECTOR_MASKS: tl.constexpr = False):  # fmt: skip
    """The rows' products ``[R, S]`` (to be summed over the slots) over 6-bit codes: the kernel's loop with each
    step's plane words beside its code words (its first ones, and with ``EARLY_PARAMS`` their parameters, read
    before the PDL wait)."""
    acc = tl.zeros((rows.shape[0], S), dtype=tl.float32)
    words = _slot_words(w32, rows, stride_w, 0, S, NUM_SLOTS, EVEN)
    plane = six_bit_plane_words(p16, rows, stride_p, 0, S, NUM_SLOTS, EVEN)
    if EARLY_PARAMS:
        scale, zs, scale_hi, zs_hi = six_bit_params(scale_ptr, zs_ptr, rows, stride_sn, 0, S, NUM_SLOTS, GROUP,
                                                    HAS_ZS, EVEN, super_ptr, zsuper_ptr, SUB_GROUPS,
                                                    PARAM_ROWS)  # fmt: skip
    if USE_PDL:
        gdc_wait()
    if not EARLY_PARAMS:
        scale, zs, scale_hi, zs_hi = six_bit_params(scale_ptr, zs_ptr, rows, stride_sn, 0, S, NUM_SLOTS, GROUP,
                                                    HAS_ZS, EVEN, super_ptr, zsuper_ptr, SUB_GROUPS,
                                                    PARAM_ROWS)  # fmt: skip
    xl0, xl1, xh0, xh1 = _slot_activations(x_ptr, perm_ptr, 0, S, NUM_SLOTS, 32, HAS_PERM, EVEN, 6, VECTOR_MASKS)
    acc = six_bit_step(acc, words, plane, scale, zs, scale_hi, zs_hi, xl0, xl1, xh0, xh1, ZERO, HAS_ZS, FP16, ASM)
    for s0 in tl.range(S, NUM_SLOTS, S):
        words = _slot_words(w32, rows, stride_w, s0, S, NUM_SLOTS, EVEN)
        plane = six_bit_plane_words(p16, rows, stride_p, s0, S, NUM_SLOTS, EVEN)
        scale, zs, scale_hi, zs_hi = six_bit_params(scale_ptr, zs_ptr, rows, stride_sn, s0, S, NUM_SLOTS, GROUP,
                                                    HAS_ZS, EVEN, super_ptr, zsuper_ptr, SUB_GROUPS,
                                                    PARAM_ROWS)  # fmt: skip
        xl0, xl1, xh0, xh1 = _slot_activations(x_ptr, perm_ptr, s0, S, NUM_SLOTS, 32, HAS_PERM, EVEN, 6,
                                               VECTOR_MASKS)  # fmt: skip
        acc = six_bit_step(acc, words, plane, scale, zs, scale_hi, zs_hi, xl0, xl1, xh0, xh1, ZERO, HAS_ZS, FP16,
                           ASM)  # fmt: skip
    return acc

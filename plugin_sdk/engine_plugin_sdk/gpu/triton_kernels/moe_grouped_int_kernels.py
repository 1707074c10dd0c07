"""Mixture-of-experts kernels over grouped-integer experts: GPTQ / AWQ / compressed-tensors int4 or int8 experts and
the GGUF types repacked into that form (:mod:`engine_plugin_sdk.grouped_codes`), kept in their codes on the device
and dequantized in registers, as the dense path's grouped-integer kernels do (:mod:`.grouped_int_kernels`).

The experts' layout is :class:`~engine_plugin_sdk.gpu.gemm.GroupedIntWeight`'s with a leading expert dimension:
codes ``[E, N, K]`` (8-bit) or ``[E, N, K / 2]`` (4-bit codes paired within each block of ``PACKED`` columns),
scales and zero scales ``[E, N, groups]`` (two-level ones with super-block scales ``[E, N, groups / SUB_GROUPS]``,
:mod:`.grouped_int_params`), an act-order permutation ``[E, K]`` per expert. A tile spans ``BLOCK_K`` columns,
``BLOCK_K / PACKED`` packed blocks: its 4-bit bytes split into a low and a high half tile by a mask and a shift,
each with its own activation columns, so no nibble moves between lanes.

The forms follow :mod:`.moe_kernels`: for few slots one program per slot (gate/up, with the gated activation)
or per token (down, its experts summed in registers in a fixed order); for many slots the grouped GEMM over
slots sorted by expert (``moe_align_kernel``), each tile dequantized once for its ``BLOCK_M`` rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.grouped_int_gemm_kernels import _tile_params
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_kernels import _dequant
from engine_plugin_sdk.gpu.triton_kernels.moe_kernels import _gated, gemm_epilogue
from engine_plugin_sdk.gpu.triton_kernels.pdl import pdl_begin


@triton.jit
def _weight_tile(w_rows, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, s_rows, n_ok, k0, BITS: tl.constexpr,
                 ZERO: tl.constexpr, HAS_ZS: tl.constexpr, PACKED: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, SUB_GROUPS: tl.constexpr):  # fmt: skip
    """float32 weights ``[BLOCK_N, W_COLS]`` of the tile at column ``k0`` of rows ``w_rows`` (parameters at flat
    offsets ``s_rows``): the low half tile and the high one (4-bit), or the whole tile twice (8-bit)."""
    NIBBLES: tl.constexpr = BITS == 4
    SUBS: tl.constexpr = BLOCK_K // PACKED
    RUN: tl.constexpr = PACKED // 2 if NIBBLES else PACKED
    W_COLS: tl.constexpr = BLOCK_K // 2 if NIBBLES else BLOCK_K
    scale = _tile_params(scale_ptr, super_ptr, s_rows, n_ok, k0, SUBS, RUN, PACKED, GROUP, SUB_GROUPS)
    zs = scale
    if HAS_ZS:
        zs = _tile_params(zs_ptr, zsuper_ptr, s_rows, n_ok, k0, SUBS, RUN, PACKED, GROUP, SUB_GROUPS)
    offs_c = tl.arange(0, W_COLS)
    if NIBBLES:
        codes = tl.load(w_rows + (k0 // 2 + offs_c)[None, :], mask=n_ok[:, None], other=0)
        return _dequant(codes & 0xF, scale, zs, ZERO, HAS_ZS), _dequant(codes >> 4, scale, zs, ZERO, HAS_ZS)
    codes = tl.load(w_rows + (k0 + offs_c)[None, :], mask=n_ok[:, None], other=0)
    w = _dequant(codes, scale, zs, ZERO, HAS_ZS)
    return w, w


@triton.jit
def _tile_columns(k0, perm_row, BITS: tl.constexpr, PACKED: tl.constexpr, BLOCK_K: tl.constexpr,
                  HAS_PERM: tl.constexpr):  # fmt: skip
    """The input columns the tile's low and high half tiles multiply (:func:`_weight_tile`), through the
    expert's act-order permutation ``perm_row`` where it has one."""
    NIBBLES: tl.constexpr = BITS == 4
    RUN: tl.constexpr = PACKED // 2 if NIBBLES else PACKED
    W_COLS: tl.constexpr = BLOCK_K // 2 if NIBBLES else BLOCK_K
    offs_c = tl.arange(0, W_COLS)
    lo = k0 + (offs_c // RUN) * PACKED + offs_c % RUN
    hi = lo + RUN
    if HAS_PERM:
        lo = tl.load(perm_row + lo)
        hi = tl.load(perm_row + hi)
    return lo, hi


@triton.jit
def moe_int_gemv_gate_up_kernel(
    x_ptr, w_ptr, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, perm_ptr, bias_ptr, ids_ptr, out_ptr,
    INTER, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_o, stride_be,
    K: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PACKED: tl.constexpr, GROUP: tl.constexpr,
    SUB_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """``out[slot, n] = act(gate_e[n] . x[token], up_e[n] . x[token])`` for one slot's expert ``e``, ``BLOCK_N``
    output features a program (the reduction unrolls: ``K`` is a compile-time constant)."""
    pdl_begin(USE_PDL)
    slot = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    x_row = x_ptr + (slot // TOP_K) * stride_x
    perm_row = perm_ptr + expert * K
    gate_rows = w_ptr + expert * stride_we + rows[:, None] * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    s_gate = expert * stride_se + rows * stride_sn
    s_up = s_gate + INTER * stride_sn
    W_COLS: tl.constexpr = BLOCK_K // 2 if BITS == 4 else BLOCK_K
    acc_g = tl.zeros((BLOCK_N, W_COLS), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, W_COLS), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        lo, hi = _tile_columns(k0, perm_row, BITS, PACKED, BLOCK_K, HAS_PERM)
        g_lo, g_hi = _weight_tile(gate_rows, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, s_gate, n_ok, k0, BITS, ZERO,
                                  HAS_ZS, PACKED, BLOCK_K, GROUP, SUB_GROUPS)  # fmt: skip
        u_lo, u_hi = _weight_tile(up_rows, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, s_up, n_ok, k0, BITS, ZERO,
                                  HAS_ZS, PACKED, BLOCK_K, GROUP, SUB_GROUPS)  # fmt: skip
        x_lo = tl.load(x_row + lo).to(tl.float32)[None, :]
        acc_g += g_lo * x_lo
        acc_u += u_lo * x_lo
        if BITS == 4:
            x_hi = tl.load(x_row + hi).to(tl.float32)[None, :]
            acc_g += g_hi * x_hi
            acc_u += u_hi * x_hi
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * stride_be + rows).to(tl.float32)
        up += tl.load(bias_ptr + expert * stride_be + rows + INTER).to(tl.float32)
    # the projections round to the activation dtype first, as a plain GEMM's output would
    gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + slot * stride_o + offs_n, _gated(gate, up, ACT).to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def moe_int_gemv_down_kernel(
    act_ptr, w_ptr, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, perm_ptr, bias_ptr, ids_ptr, topw_ptr, out_ptr,
    H, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_o, stride_be,
    K: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, PACKED: tl.constexpr, GROUP: tl.constexpr,
    SUB_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """``out[t, n] = sum_j w[t, j] * (down_{e_j}[n] . act[t * TOP_K + j])``: one token's experts, summed in
    registers in their routing order (no atomics, so the sum is the same run to run)."""
    pdl_begin(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    W_COLS: tl.constexpr = BLOCK_K // 2 if BITS == 4 else BLOCK_K
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = t * TOP_K + j
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        a_row = act_ptr + slot * stride_a
        perm_row = perm_ptr + expert * K
        w_rows = w_ptr + expert * stride_we + rows[:, None] * stride_wn
        s_rows = expert * stride_se + rows * stride_sn
        acc = tl.zeros((BLOCK_N, W_COLS), dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            lo, hi = _tile_columns(k0, perm_row, BITS, PACKED, BLOCK_K, HAS_PERM)
            w_lo, w_hi = _weight_tile(w_rows, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, s_rows, n_ok, k0, BITS, ZERO,
                                      HAS_ZS, PACKED, BLOCK_K, GROUP, SUB_GROUPS)  # fmt: skip
            acc += w_lo * tl.load(a_row + lo).to(tl.float32)[None, :]
            if BITS == 4:
                acc += w_hi * tl.load(a_row + hi).to(tl.float32)[None, :]
        part = tl.sum(acc, axis=1)
        if HAS_BIAS:
            part += tl.load(bias_ptr + expert * stride_be + rows).to(tl.float32)
        y += tl.load(topw_ptr + slot).to(tl.float32) * part
    tl.store(out_ptr + t * stride_o + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _dot_tile(acc, a_rows, valid, w_rows, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, s_rows, n_ok, k0, perm_row,
              BITS: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr, HAS_PERM: tl.constexpr,
              PACKED: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, SUB_GROUPS: tl.constexpr,
              PRECISION: tl.constexpr):  # fmt: skip
    """``acc += a[:, tile columns] @ dequant(tile).T`` for the tile at ``k0``, in the activations' dtype."""
    lo, hi = _tile_columns(k0, perm_row, BITS, PACKED, BLOCK_K, HAS_PERM)
    w_lo, w_hi = _weight_tile(w_rows, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, s_rows, n_ok, k0, BITS, ZERO, HAS_ZS,
                              PACKED, BLOCK_K, GROUP, SUB_GROUPS)  # fmt: skip
    a_lo = tl.load(a_rows + lo[None, :], mask=valid[:, None], other=0.0)
    acc = tl.dot(a_lo, tl.trans(w_lo.to(a_lo.dtype)), acc, input_precision=PRECISION)
    if BITS == 4:
        a_hi = tl.load(a_rows + hi[None, :], mask=valid[:, None], other=0.0)
        acc = tl.dot(a_hi, tl.trans(w_hi.to(a_hi.dtype)), acc, input_precision=PRECISION)
    return acc


@triton.jit
def moe_int_gemm_kernel(
    a_ptr, w_ptr, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, perm_ptr, bias_ptr, sorted_ptr, block_expert_ptr,
    total_ptr, topw_ptr, c_ptr, N, K, num_slots, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    stride_be, A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, BITS: tl.constexpr,
    ZERO: tl.constexpr, HAS_ZS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    PACKED: tl.constexpr, GROUP: tl.constexpr, SUB_GROUPS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """One block of an expert's group of slots against one tile of its weight's rows, as
    :func:`~.moe_kernels.moe_gemm_kernel` (row ``i`` is slot ``sorted[i]``, its activations ``a[slot // A_DIV]``,
    its result ``c[slot]``; ``GATED`` reads rows ``n`` and ``n + N`` and writes their gated activation;
    ``MUL_WEIGHT`` scales a row by its slot's routing weight), each weight tile dequantized in registers."""
    pdl_begin(USE_PDL)
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = slots < num_slots
    a_rows = a_ptr + tl.where(valid, slots // A_DIV, 0)[:, None] * stride_am
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    perm_row = perm_ptr + expert * K
    w_rows = w_ptr + expert * stride_we + rows[:, None] * stride_wn
    s_rows = expert * stride_se + rows * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = _dot_tile(acc, a_rows, valid, w_rows, scale_ptr, zs_ptr, super_ptr, zsuper_ptr, s_rows, n_ok, k0,
                        perm_row, BITS, ZERO, HAS_ZS, HAS_PERM, PACKED, BLOCK_K, GROUP, SUB_GROUPS, PRECISION)  # fmt: skip
        if GATED:
            acc_u = _dot_tile(acc_u, a_rows, valid, w_rows + N * stride_wn, scale_ptr, zs_ptr, super_ptr, zsuper_ptr,
                              s_rows + N * stride_sn, n_ok, k0, perm_row, BITS, ZERO, HAS_ZS, HAS_PERM, PACKED, BLOCK_K,
                              GROUP, SUB_GROUPS, PRECISION)  # fmt: skip
    gemm_epilogue(acc, acc_u, bias_ptr + expert * stride_be, rows, N, topw_ptr, slots, valid, c_ptr, stride_cm, offs_n,
                  n_ok, GATED, MUL_WEIGHT, HAS_BIAS, ACT)  # fmt: skip

"""The grouped-integer products of many rows (:mod:`.grouped_int_kernels` has the layout and the GEMVs): the tiled
GEMM, each program dequantizing ``[BLOCK_N, BLOCK_K]`` tiles of codes in registers for ``tl.dot`` in the
activations' dtype, and the dense copy that a product of many rows hands to the vendor GEMM instead."""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.grouped_int_kernels import _dequant
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_params import group_params, group_params_masked
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_six_bit import six_bit_halves
from engine_plugin_sdk.gpu.triton_kernels.pdl import pdl_begin


@triton.jit
def _load_x(x_rows, m_ok, perm_ptr, offs_k, HAS_PERM: tl.constexpr):
    """Activation columns ``offs_k`` (stored order) of the block's rows: ``x[:, perm[offs_k]]``."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + offs_k)
    else:
        cols = offs_k
    return tl.load(x_rows + cols[None, :], mask=m_ok[:, None], other=0.0)


@triton.jit
def _tile_params(p_ptr, super_ptr, s_rows, n_ok, k0, SUBS: tl.constexpr, RUN: tl.constexpr, SUB: tl.constexpr,
                 GROUP: tl.constexpr, SUB_GROUPS: tl.constexpr):  # fmt: skip
    """float32 ``[BLOCK_N, 1]`` scales (or zero scales) of a tile within one block; across ``SUBS`` packed blocks,
    each block's broadcast over its ``RUN`` columns of the tile's ``[BLOCK_N, SUBS * RUN]``
    (:mod:`.grouped_int_params`)."""
    if SUBS == 1:
        tile = group_params_masked(p_ptr, super_ptr, s_rows + k0 // GROUP, n_ok, SUB_GROUPS)[:, None]
    else:
        groups = (k0 + tl.arange(0, SUBS) * SUB) // GROUP
        params = group_params_masked(p_ptr, super_ptr, s_rows[:, None] + groups[None, :], n_ok[:, None], SUB_GROUPS)
        tile = tl.reshape(tl.broadcast_to(params[:, :, None], (params.shape[0], SUBS, RUN)), (params.shape[0], SUBS * RUN))
    return tile


@triton.jit
def grouped_int_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr,
    M, N, k_per_split, stride_xm, stride_wn, stride_sn, stride_om, stride_os,
    K: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    SUB: tl.constexpr = 0, super_ptr=None, zsuper_ptr=None, SUB_GROUPS: tl.constexpr = 0, plane_ptr=None,
    stride_pn=0,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` output tile over the ``k_per_split`` reduction columns of split ``pid(2)``.

    ``w`` holds the packed codes (see the module docstring) in blocks of ``SUB`` columns (0: ``BLOCK_K``); a
    tile of ``BLOCK_K`` columns (a multiple of ``SUB``) spans ``BLOCK_K / SUB`` of them, each with its own
    scales (GGUF's 32-column blocks would otherwise make 32-column tiles: too little work an iteration).
    ``scale`` / ``zs`` ``[N, groups]`` scales and ``zeros * scales`` (``zs`` read only with ``HAS_ZS``), ``perm``
    int32 ``[K]`` (read only with ``HAS_PERM``), ``bias`` ``[N]`` (only with ``HAS_BIAS``, which the launcher
    sets for an unsplit reduction alone). ``out`` is ``[M, N]`` in its own dtype, or float32 partial sums
    ``[splits, M, N]`` when the reduction is split. 6-bit codes (``BITS`` 6, ``SUB`` 32): ``w`` their low nibbles as
    4-bit codes', ``plane`` their high bits (:mod:`.grouped_int_six_bit`), a block's halves each with its group's
    scales.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PACKED: tl.constexpr = BLOCK_K if SUB == 0 else SUB
    SUBS: tl.constexpr = BLOCK_K // PACKED
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    # 4-bit: a block's columns r and PACKED / 2 + r share byte r of its PACKED / 2; a tile's bytes are its blocks'
    NIBBLES: tl.constexpr = BITS != 8
    W_COLS: tl.constexpr = BLOCK_K // 2 if NIBBLES else BLOCK_K
    RUN: tl.constexpr = PACKED // 2 if NIBBLES else PACKED
    # a 6-bit block's high half in the next group (Q6_K's groups of 16)
    SPLIT_GROUPS: tl.constexpr = BITS == 6 and GROUP % PACKED != 0
    offs_c = tl.arange(0, W_COLS)
    # the column (relative to the tile) of byte c's code, or of its low nibble
    cols_c = (offs_c // RUN) * PACKED + offs_c % RUN
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    pdl_begin(USE_PDL)
    for k0 in range(k_begin, k_end, BLOCK_K):
        scale = _tile_params(scale_ptr, super_ptr, s_rows, n_ok, k0, SUBS, RUN, PACKED, GROUP, SUB_GROUPS)
        zs = scale
        if HAS_ZS:
            zs = _tile_params(zs_ptr, zsuper_ptr, s_rows, n_ok, k0, SUBS, RUN, PACKED, GROUP, SUB_GROUPS)
        if NIBBLES:
            w_col0 = k0 // 2
        else:
            w_col0 = k0
        codes = tl.load(w_rows + (w_col0 + offs_c)[None, :], mask=n_ok[:, None], other=0)
        if BITS == 6:
            x_lo = _load_x(x_rows, m_ok, perm_ptr, k0 + cols_c, HAS_PERM)
            x_hi = _load_x(x_rows, m_ok, perm_ptr, k0 + RUN + cols_c, HAS_PERM)
            p_rows = plane_ptr + offs_n.to(tl.int64)[:, None] * stride_pn
            low, high = six_bit_halves(codes, p_rows, k0 // 4, n_ok[:, None])
            scale_hi, zs_hi = scale, zs
            if SPLIT_GROUPS:
                scale_hi = _tile_params(scale_ptr, super_ptr, s_rows, n_ok, k0 + RUN, SUBS, RUN, PACKED, GROUP,
                                        SUB_GROUPS)  # fmt: skip
                zs_hi = scale_hi
                if HAS_ZS:
                    zs_hi = _tile_params(zs_ptr, zsuper_ptr, s_rows, n_ok, k0 + RUN, SUBS, RUN, PACKED, GROUP,
                                         SUB_GROUPS)  # fmt: skip
            w_lo = _dequant(low, scale, zs, ZERO, HAS_ZS)
            w_hi = _dequant(high, scale_hi, zs_hi, ZERO, HAS_ZS)
            acc = tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), acc, input_precision=PRECISION)
            acc = tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), acc, input_precision=PRECISION)
        elif BITS == 4:
            x_lo = _load_x(x_rows, m_ok, perm_ptr, k0 + cols_c, HAS_PERM)
            x_hi = _load_x(x_rows, m_ok, perm_ptr, k0 + RUN + cols_c, HAS_PERM)
            w_lo = _dequant(codes & 0xF, scale, zs, ZERO, HAS_ZS)
            w_hi = _dequant(codes >> 4, scale, zs, ZERO, HAS_ZS)
            acc = tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), acc, input_precision=PRECISION)
            acc = tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), acc, input_precision=PRECISION)
        else:
            x = _load_x(x_rows, m_ok, perm_ptr, k0 + offs_c, HAS_PERM)
            w = _dequant(codes, scale, zs, ZERO, HAS_ZS)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = (
        out_ptr + pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    )
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def grouped_int_dequant_kernel(
    w_ptr, scale_ptr, zs_ptr, out_ptr, N, stride_wn, stride_sn, stride_on,
    GROUP: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, super_ptr=None, zsuper_ptr=None, SUB_GROUPS: tl.constexpr = 0,
    plane_ptr=None, stride_pn=0,
):  # fmt: skip
    """``out[n, k] = dequant(W)[n, k]`` in ``out``'s dtype, stored column order, for ``BLOCK_N`` rows and the
    packing's sub-block ``pid(1)`` of ``BLOCK`` columns: the dense copy a many-row product hands to the
    vendor GEMM, where dequantizing once per tile of rows inside the grouped GEMM costs more than the copy.
    6-bit codes as in :func:`grouped_int_gemm_kernel`."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    block = tl.program_id(1)
    W_COLS: tl.constexpr = BLOCK // 2 if BITS != 8 else BLOCK
    offs_c = tl.arange(0, W_COLS)
    codes = tl.load(w_ptr + rows[:, None] * stride_wn + (block * W_COLS + offs_c)[None, :])
    params = rows * stride_sn + block * BLOCK // GROUP
    scale = group_params(scale_ptr, super_ptr, params, SUB_GROUPS)[:, None]
    zs = scale
    if HAS_ZS:
        zs = group_params(zs_ptr, zsuper_ptr, params, SUB_GROUPS)[:, None]
    out_rows = out_ptr + rows[:, None] * stride_on + block * BLOCK + offs_c[None, :]
    if BITS == 6:
        low, high = six_bit_halves(codes, plane_ptr + rows[:, None] * stride_pn, block * (BLOCK // 4), n_ok[:, None])
        high_params = rows * stride_sn + (block * BLOCK + W_COLS) // GROUP
        scale_hi = group_params(scale_ptr, super_ptr, high_params, SUB_GROUPS)[:, None]
        zs_hi = scale_hi
        if HAS_ZS:
            zs_hi = group_params(zs_ptr, zsuper_ptr, high_params, SUB_GROUPS)[:, None]
        tl.store(out_rows, _dequant(low, scale, zs, ZERO, HAS_ZS).to(out_ptr.dtype.element_ty), mask=n_ok[:, None])
        tl.store(out_rows + W_COLS, _dequant(high, scale_hi, zs_hi, ZERO, HAS_ZS).to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None])  # fmt: skip
    elif BITS == 4:
        tl.store(out_rows, _dequant(codes & 0xF, scale, zs, ZERO, HAS_ZS).to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None])  # fmt: skip
        tl.store(out_rows + W_COLS, _dequant(codes >> 4, scale, zs, ZERO, HAS_ZS).to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None])  # fmt: skip
    else:
        tl.store(out_rows, _dequant(codes, scale, zs, ZERO, HAS_ZS).to(out_ptr.dtype.element_ty), mask=n_ok[:, None])

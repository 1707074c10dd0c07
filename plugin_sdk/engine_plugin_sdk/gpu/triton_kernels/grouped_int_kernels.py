"""Weight-only GEMM over grouped integer weights (``int4_grouped`` / ``int8_grouped``, the layout of
:mod:`engine.interfaces.grouped_int`): ``y = x[:, perm] @ dequant(W).T (+ bias)``.

The weight stays in its codes in device memory; each program dequantizes its ``[BLOCK_K, BLOCK_N]`` tile in
registers (``code * scale - zero * scale``, one scale row per tile) and feeds it to ``tl.dot`` in the
activations' dtype, accumulating in float32. Reading 4 or 8 bits a weight instead of 16 is the point: at
decode batch sizes the GEMM is bound by the weight's bytes.

The launcher repacks the weight at load into the layout the tile loads want (:func:`~engine_plugin_sdk.gpu.
triton_kernels.grouped_int_launchers.pack_grouped_int`):

- codes K-major, ``[K, N]`` bytes (8-bit) or ``[K / 2, N]`` (4-bit), so that a tile's rows are contiguous
  runs of output columns;
- 4-bit codes paired *within* each block of ``BLOCK_K`` columns: byte row ``b * BLOCK_K / 2 + r`` holds
  column ``b * BLOCK_K + r`` in its low nibble and column ``b * BLOCK_K + BLOCK_K / 2 + r`` in its high
  one. A tile then splits into two half tiles by a mask and a shift, each multiplied by its own half of
  the activation columns: no interleaving of nibbles in registers (a layout shuffle on the GPU);
- ``BLOCK_K`` divides the group size, so every tile lies in one group and its scales are one row;
- scales and ``zeros * scales`` transposed to float32 ``[groups, N]``, one contiguous row per tile.

The act-order permutation is a gathered load of the activations' columns (``HAS_PERM``), so it costs no
extra pass over ``x``. With ``SPLIT_K > 1`` the reduction is split across programs, each writing float32
partial sums that the launcher adds: that fills the GPU when few output tiles (a decode batch, a narrow
projection) would leave most multiprocessors idle.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_x(x_rows, m_ok, perm_ptr, offs_k, HAS_PERM: tl.constexpr):
    """Activation columns ``offs_k`` (stored order) of the block's rows: ``x[:, perm[offs_k]]``."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + offs_k)
    else:
        cols = offs_k
    return tl.load(x_rows + cols[None, :], mask=m_ok[:, None], other=0.0)


@triton.jit
def grouped_int_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr,
    M, N, k_per_split, stride_xm, stride_wk, stride_sg, stride_om, stride_os,
    K: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` output tile over the ``k_per_split`` reduction columns of split ``pid(2)``.

    ``w`` holds the packed codes (see the module docstring), ``scale`` / ``zs`` float32 ``[groups, N]``
    scales and ``zeros * scales``, ``perm`` int32 ``[K]`` (read only with ``HAS_PERM``), ``bias`` ``[N]``
    (only with ``HAS_BIAS``, which the launcher sets for an unsplit reduction alone). ``out`` is ``[M, N]``
    in its own dtype, or float32 partial sums ``[splits, M, N]`` when the reduction is split.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    # 4-bit: a tile's BLOCK_K columns are BLOCK_K / 2 byte rows, each column pair sharing a byte
    W_ROWS: tl.constexpr = BLOCK_K // 2 if BITS == 4 else BLOCK_K
    offs_r = tl.arange(0, W_ROWS)
    w_cols = w_ptr + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        group = k0 // GROUP
        scale = tl.load(scale_ptr + group * stride_sg + offs_n, mask=n_ok, other=0.0)[None, :]
        zs = tl.load(zs_ptr + group * stride_sg + offs_n, mask=n_ok, other=0.0)[None, :]
        if BITS == 4:
            w_row0 = k0 // 2
        else:
            w_row0 = k0
        codes = tl.load(
            w_cols + (w_row0 + offs_r).to(tl.int64)[:, None] * stride_wk, mask=n_ok[None, :], other=0
        )
        if BITS == 4:
            x_lo = _load_x(x_rows, m_ok, perm_ptr, k0 + offs_r, HAS_PERM)
            x_hi = _load_x(x_rows, m_ok, perm_ptr, k0 + W_ROWS + offs_r, HAS_PERM)
            w_lo = (codes & 0xF).to(tl.float32) * scale - zs
            w_hi = (codes >> 4).to(tl.float32) * scale - zs
            acc = tl.dot(x_lo, w_lo.to(x_lo.dtype), acc, input_precision=PRECISION)
            acc = tl.dot(x_hi, w_hi.to(x_hi.dtype), acc, input_precision=PRECISION)
        else:
            x = _load_x(x_rows, m_ok, perm_ptr, k0 + offs_r, HAS_PERM)
            w = codes.to(tl.float32) * scale - zs
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = (
        out_ptr + pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    )
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

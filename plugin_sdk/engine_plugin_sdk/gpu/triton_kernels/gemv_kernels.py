"""A weight-streaming GEMV for one activation row: ``y[n] = sum_k x[k] * W[n, k]``.

At batch 1 a projection reads every weight byte once and does two flops per byte pair, so its speed is
the memory bandwidth the kernel reaches. Each program owns ``BLOCK_N`` output rows and streams their
weights in ``BLOCK_K``-wide tiles (contiguous along K, so loads are wide), accumulating in float32.

With programmatic dependent launch (``USE_PDL``, see :mod:`.pdl`) a program loads its first weight tile
before it waits for the kernel that wrote ``x``: weights are constant, so that read overlaps the previous
kernel's tail.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import gated_product, summed_row_rms
from engine_plugin_sdk.gpu.triton_kernels.l2_prefetch import ask_l2_share
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _tile(x_ptr, w_ptr, rows, stride_w, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        w = tl.load(w_ptr + rows[:, None] * stride_w + offs_k[None, :])
    else:
        w = tl.load(w_ptr + rows[:, None] * stride_w + offs_k[None, :], mask=offs_k[None, :] < K, other=0.0)
    return w, offs_k


@triton.jit
def _x_tile(x_ptr, offs_k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptr + offs_k).to(tl.float32)
    else:
        return tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)


@triton.jit
def _load_ahead(w_ptr, rows, stride_w, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr):
    """The first ``PREFETCH`` weight tiles of a program's rows (slots past it repeat the first, unread)."""
    w0, _ = _tile(w_ptr, w_ptr, rows, stride_w, 0, K, BLOCK_K, EVEN_K)
    w1 = w0
    w2 = w0
    w3 = w0
    if PREFETCH >= 2:
        w1, _ = _tile(w_ptr, w_ptr, rows, stride_w, BLOCK_K, K, BLOCK_K, EVEN_K)
    if PREFETCH >= 3:
        w2, _ = _tile(w_ptr, w_ptr, rows, stride_w, 2 * BLOCK_K, K, BLOCK_K, EVEN_K)
    if PREFETCH >= 4:
        w3, _ = _tile(w_ptr, w_ptr, rows, stride_w, 3 * BLOCK_K, K, BLOCK_K, EVEN_K)
    return w0, w1, w2, w3


@triton.jit
def _take_ahead(acc, x_ptr, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, w0, w1, w2, w3):
    """``acc`` plus the prefetched tiles times their activations, tile by tile in K order (the same sums,
    in the same order, as the loop would make)."""
    offs = tl.arange(0, BLOCK_K)
    acc += w0.to(tl.float32) * _x_tile(x_ptr, offs, K, EVEN_K)[None, :]
    if PREFETCH >= 2:
        acc += w1.to(tl.float32) * _x_tile(x_ptr, BLOCK_K + offs, K, EVEN_K)[None, :]
    if PREFETCH >= 3:
        acc += w2.to(tl.float32) * _x_tile(x_ptr, 2 * BLOCK_K + offs, K, EVEN_K)[None, :]
    if PREFETCH >= 4:
        acc += w3.to(tl.float32) * _x_tile(x_ptr, 3 * BLOCK_K + offs, K, EVEN_K)[None, :]
    return acc


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    N, K, stride_w,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr = 1,
):
    """``PREFETCH`` (1 to 4, with ``K >= PREFETCH * BLOCK_K``): weight tiles loaded before the PDL wait."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # rows past N read row 0 instead of masking: keeps the loads unmasked along N (wide and unpredicated)
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_first = 0
    if USE_PDL:
        gdc_launch_dependents()
        w0, w1, w2, w3 = _load_ahead(w_ptr, rows, stride_w, K, BLOCK_K, EVEN_K, PREFETCH)
        gdc_wait()
        acc = _take_ahead(acc, x_ptr, K, BLOCK_K, EVEN_K, PREFETCH, w0, w1, w2, w3)
        k_first = PREFETCH * BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        w, offs_k = _tile(x_ptr, w_ptr, rows, stride_w, k0, K, BLOCK_K, EVEN_K)
        acc += w.to(tl.float32) * _x_tile(x_ptr, offs_k, K, EVEN_K)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def gated_gemv_kernel(
    x_ptr, w_ptr, y_ptr,
    N, K, stride_w,
    ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr = 1,
):
    """``y[n] = act(x . W[n]) * (x . W[N + n])``: the gated MLP's fused gate/up GEMV with its activation
    as the epilogue (``W`` stacks the ``N`` gate rows over the ``N`` up rows).

    Each program streams ``BLOCK_N`` gate rows and the matching up rows, so the activation sees both
    float32 accumulators: no ``2N``-wide intermediate is written and read back, and the step has one
    launch fewer per layer (at batch 1 a launch costs as much as a few MB of weights). ``PREFETCH`` as
    for :func:`gemv_kernel`.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    gates = tl.where(n_ok, offs_n, 0).to(tl.int64)
    ups = gates + N
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_first = 0
    if USE_PDL:
        gdc_launch_dependents()
        g0, g1, g2, g3 = _load_ahead(w_ptr, gates, stride_w, K, BLOCK_K, EVEN_K, PREFETCH)
        u0, u1, u2, u3 = _load_ahead(w_ptr, ups, stride_w, K, BLOCK_K, EVEN_K, PREFETCH)
        gdc_wait()
        acc_g = _take_ahead(acc_g, x_ptr, K, BLOCK_K, EVEN_K, PREFETCH, g0, g1, g2, g3)
        acc_u = _take_ahead(acc_u, x_ptr, K, BLOCK_K, EVEN_K, PREFETCH, u0, u1, u2, u3)
        k_first = PREFETCH * BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        w_g, offs_k = _tile(x_ptr, w_ptr, gates, stride_w, k0, K, BLOCK_K, EVEN_K)
        w_u, offs_k = _tile(x_ptr, w_ptr, ups, stride_w, k0, K, BLOCK_K, EVEN_K)
        x = _x_tile(x_ptr, offs_k, K, EVEN_K)[None, :]
        acc_g += w_g.to(tl.float32) * x
        acc_u += w_u.to(tl.float32) * x
    y = gated_product(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), ACT)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _normed_tile(x_ptr, res_ptr, nw_ptr, out_ptr, offs_k, K, inv, EVEN_K: tl.constexpr):
    """Columns ``offs_k`` of ``rms_norm(x + residual) * w`` as the norm kernel writes them: the sum rounded to
    ``out_ptr``'s dtype, then ``s * inv * w`` rounded again (``inv`` the row's inverse root mean square)."""
    s = (_x_tile(x_ptr, offs_k, K, EVEN_K) + _x_tile(res_ptr, offs_k, K, EVEN_K)).to(out_ptr.dtype.element_ty)
    normed = s.to(tl.float32) * inv * _x_tile(nw_ptr, offs_k, K, EVEN_K)
    return normed.to(out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def add_rms_norm_gemv_kernel(
    x_ptr, res_ptr, nw_ptr, w_ptr, bias_ptr, y_ptr, normed_ptr, summed_ptr, eps,
    N, K, stride_w,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ROW: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr = 1,
    l2_ptr=None, l2_lines=0, L2_LINES: tl.constexpr = 0, L2_ASM: tl.constexpr = False,
):
    """:func:`gemv_kernel` over ``n = rms_norm(x + residual) * nw`` (a mixture of experts' router after its norm):
    every program sums the row and its squares itself (``ROW``, the power of two at or above ``K``, in one block)
    and normalises each tile as it multiplies it; the first stores ``s = x + residual`` and ``n``, which the experts
    read next. Why: the router is a few programs, so the row's sum in each costs less than the norm's own launch
    between the attention's output projection and the router. ``PREFETCH`` as for :func:`gemv_kernel`.

    ``L2_LINES`` (an experiment, off unless a benchmark asks): past the wait each program asks the L2 cache for its
    share of a later product's weight (:func:`.l2_prefetch.ask_l2_share`), which the memory, idle while the router
    and the routing run, can bring in before it is read."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    if USE_PDL:
        gdc_launch_dependents()
        w0, w1, w2, w3 = _load_ahead(w_ptr, rows, stride_w, K, BLOCK_K, EVEN_K, PREFETCH)
        gdc_wait()
    if L2_LINES > 0:
        ask_l2_share(l2_ptr, l2_lines, L2_LINES, L2_ASM)
    cols = tl.arange(0, ROW)
    ok = cols < K
    first = cols < tl.where(pid == 0, K, 0)  # the first program's columns
    s, inv = summed_row_rms(summed_ptr, x_ptr, res_ptr, eps, 0, cols, ok, first, 0, 0, 0, K)
    nw = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(normed_ptr + cols, (s * inv * nw).to(normed_ptr.dtype.element_ty), mask=first)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_first = 0
    if USE_PDL:
        offs = tl.arange(0, BLOCK_K)
        acc += w0.to(tl.float32) * _normed_tile(x_ptr, res_ptr, nw_ptr, summed_ptr, offs, K, inv, EVEN_K)[None, :]
        if PREFETCH >= 2:
            n1 = _normed_tile(x_ptr, res_ptr, nw_ptr, summed_ptr, BLOCK_K + offs, K, inv, EVEN_K)
            acc += w1.to(tl.float32) * n1[None, :]
        if PREFETCH >= 3:
            n2 = _normed_tile(x_ptr, res_ptr, nw_ptr, summed_ptr, 2 * BLOCK_K + offs, K, inv, EVEN_K)
            acc += w2.to(tl.float32) * n2[None, :]
        if PREFETCH >= 4:
            n3 = _normed_tile(x_ptr, res_ptr, nw_ptr, summed_ptr, 3 * BLOCK_K + offs, K, inv, EVEN_K)
            acc += w3.to(tl.float32) * n3[None, :]
        k_first = PREFETCH * BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        w, offs_k = _tile(x_ptr, w_ptr, rows, stride_w, k0, K, BLOCK_K, EVEN_K)
        acc += w.to(tl.float32) * _normed_tile(x_ptr, res_ptr, nw_ptr, summed_ptr, offs_k, K, inv, EVEN_K)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)

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
def gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    N, K, stride_w,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # rows past N read row 0 instead of masking: keeps the loads unmasked along N (wide and unpredicated)
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_first = 0
    if USE_PDL:
        gdc_launch_dependents()
        w, offs_k = _tile(x_ptr, w_ptr, rows, stride_w, 0, K, BLOCK_K, EVEN_K)
        gdc_wait()
        acc += w.to(tl.float32) * _x_tile(x_ptr, offs_k, K, EVEN_K)[None, :]
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        w, offs_k = _tile(x_ptr, w_ptr, rows, stride_w, k0, K, BLOCK_K, EVEN_K)
        acc += w.to(tl.float32) * _x_tile(x_ptr, offs_k, K, EVEN_K)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)

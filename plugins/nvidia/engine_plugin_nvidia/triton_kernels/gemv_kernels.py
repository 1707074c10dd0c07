"""A weight-streaming GEMV for one activation row: ``y[n] = sum_k x[k] * W[n, k]``.

At batch 1 a projection reads every weight byte once and does two flops per byte pair, so its speed is
the memory bandwidth the kernel reaches. Each program owns ``BLOCK_N`` output rows and streams their
weights in ``BLOCK_K``-wide tiles (contiguous along K, so loads are wide), accumulating in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    N, K, stride_w,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # rows past N read row 0 instead of masking: keeps the loads unmasked along N (wide and unpredicated)
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + offs_k).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * stride_w + offs_k[None, :]).to(tl.float32)
        else:
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * stride_w + offs_k[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)

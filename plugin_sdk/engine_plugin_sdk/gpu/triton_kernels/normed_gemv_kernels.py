"""Single-row GEMVs whose input is a residual stream normalised on the way in (``GemmBackend.normed_linear``).

At batch 1 a decoder layer's norm is a kernel of its own between two GEMVs, and in a CUDA graph each such
launch costs as much as a few megabytes of weights. Every GEMV program streams the whole input row anyway,
so it can build the normalised row itself: per ``BLOCK_K`` tile it reads the branch output ``x`` and the
residual, forms ``s = x + residual`` (rounded to the residual's dtype, as the unfused sum is stored) and
multiplies the weight tile by ``s * norm_weight``; the RMS statistic of ``s`` accumulates alongside, and
scales the row sums at the end (``y = rsqrt(mean(s^2) + eps) * sum_k W[n, k] s[k] w[k]``). Program 0 also
stores ``s``: the next residual stream, written to its own buffer (other programs still read the old one).

``POST_NORM`` (Gemma 2): ``x`` first passes its own RMS norm (``post_weight``), whose statistic a first
pass over ``x`` finds; that pass reads what the previous kernel wrote, so it follows the PDL wait.

The normalised row is not rounded to the activation dtype before the product as the unfused norm's output
would be: the result differs from the unfused pair by that rounding only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import gated_product
from engine_plugin_sdk.gpu.triton_kernels.gemv_kernels import _tile, _x_tile
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _inv_rms(x_ptr, K, eps, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` of the row ``x`` ``[K]``, in float32."""
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xv = _x_tile(x_ptr, k0 + tl.arange(0, BLOCK_K), K, EVEN_K)
        squares += xv * xv
    return 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)


@triton.jit
def _stream_tile(
    x_ptr, res_ptr, res_out_ptr, norm_w_ptr, post_w_ptr, offs_k, K, post_inv, pid,
    EVEN_K: tl.constexpr, POST_NORM: tl.constexpr,
):  # fmt: skip
    """One tile of the stream: ``s * norm_weight`` in float32 (the product's input before the row's RMS
    scale) and ``s``'s squares summed; program 0 stores ``s``."""
    k_ok = offs_k < K
    xv = _x_tile(x_ptr, offs_k, K, EVEN_K)
    r = _x_tile(res_ptr, offs_k, K, EVEN_K)
    w = _x_tile(norm_w_ptr, offs_k, K, EVEN_K)
    if POST_NORM:
        # the branch's post-norm, rounded to its dtype as the unfused op stores it
        xv = (xv * post_inv * _x_tile(post_w_ptr, offs_k, K, EVEN_K)).to(x_ptr.dtype.element_ty).to(tl.float32)
    s = (xv + r).to(res_out_ptr.dtype.element_ty)
    # the program id broadcast by hand: a scalar condition in a mask trips Triton's interpreter
    tl.store(res_out_ptr + offs_k, s, mask=k_ok & ((offs_k * 0 + pid) == 0))
    sf = s.to(tl.float32)
    return sf * w, tl.sum(sf * sf, 0)


@triton.jit
def normed_gemv_kernel(
    x_ptr, res_ptr, res_out_ptr, norm_w_ptr, post_w_ptr, w_ptr, bias_ptr, y_ptr,
    N, K, stride_w, eps,
    HAS_BIAS: tl.constexpr, POST_NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """``y[n] = W[n] . rms_norm(s) (+ bias[n])`` with ``s = x + residual`` built per tile (module docstring)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = 0.0
    post_inv = 1.0
    k_first = 0
    if USE_PDL:
        # the first weight tile is loaded before the wait: weights are constant
        gdc_launch_dependents()
        w, offs_k = _tile(x_ptr, w_ptr, rows, stride_w, 0, K, BLOCK_K, EVEN_K)
        gdc_wait()
        if POST_NORM:
            post_inv = _inv_rms(x_ptr, K, eps, BLOCK_K, EVEN_K)
        xs, part = _stream_tile(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, post_w_ptr, offs_k, K, post_inv, pid,
                                EVEN_K, POST_NORM)  # fmt: skip
        acc += w.to(tl.float32) * xs[None, :]
        squares += part
        k_first = BLOCK_K
    elif POST_NORM:
        post_inv = _inv_rms(x_ptr, K, eps, BLOCK_K, EVEN_K)
    for k0 in range(k_first, K, BLOCK_K):
        w, offs_k = _tile(x_ptr, w_ptr, rows, stride_w, k0, K, BLOCK_K, EVEN_K)
        xs, part = _stream_tile(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, post_w_ptr, offs_k, K, post_inv, pid,
                                EVEN_K, POST_NORM)  # fmt: skip
        acc += w.to(tl.float32) * xs[None, :]
        squares += part
    y = tl.sum(acc, axis=1) * (1.0 / tl.sqrt(squares / K + eps))
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def normed_gated_gemv_kernel(
    x_ptr, res_ptr, res_out_ptr, norm_w_ptr, post_w_ptr, w_ptr, y_ptr,
    N, K, stride_w, eps,
    ACT: tl.constexpr, POST_NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """``y[n] = act(G[n] . rms_norm(s)) * (U[n] . rms_norm(s))``: the gated GEMV of
    :func:`~.gemv_kernels.gated_gemv_kernel` on the stream built per tile (``W`` stacks ``N`` gate rows
    over ``N`` up rows)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    gates = tl.where(n_ok, offs_n, 0).to(tl.int64)
    ups = gates + N
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = 0.0
    post_inv = 1.0
    k_first = 0
    if USE_PDL:
        gdc_launch_dependents()
        w_g, offs_k = _tile(x_ptr, w_ptr, gates, stride_w, 0, K, BLOCK_K, EVEN_K)
        w_u, offs_k = _tile(x_ptr, w_ptr, ups, stride_w, 0, K, BLOCK_K, EVEN_K)
        gdc_wait()
        if POST_NORM:
            post_inv = _inv_rms(x_ptr, K, eps, BLOCK_K, EVEN_K)
        xs, part = _stream_tile(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, post_w_ptr, offs_k, K, post_inv, pid,
                                EVEN_K, POST_NORM)  # fmt: skip
        acc_g += w_g.to(tl.float32) * xs[None, :]
        acc_u += w_u.to(tl.float32) * xs[None, :]
        squares += part
        k_first = BLOCK_K
    elif POST_NORM:
        post_inv = _inv_rms(x_ptr, K, eps, BLOCK_K, EVEN_K)
    for k0 in range(k_first, K, BLOCK_K):
        w_g, offs_k = _tile(x_ptr, w_ptr, gates, stride_w, k0, K, BLOCK_K, EVEN_K)
        w_u, offs_k = _tile(x_ptr, w_ptr, ups, stride_w, k0, K, BLOCK_K, EVEN_K)
        xs, part = _stream_tile(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, post_w_ptr, offs_k, K, post_inv, pid,
                                EVEN_K, POST_NORM)  # fmt: skip
        acc_g += w_g.to(tl.float32) * xs[None, :]
        acc_u += w_u.to(tl.float32) * xs[None, :]
        squares += part
    inv = 1.0 / tl.sqrt(squares / K + eps)
    y = gated_product(tl.sum(acc_g, axis=1) * inv, tl.sum(acc_u, axis=1) * inv, ACT)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)

"""A few tokens' residual add, RMS norm, router product and softmax top-k routing in one kernel.

At batch 1 a mixture-of-experts layer's routing is three small launches after the attention: the residual norm
(one program), the router GEMV (a fraction of a MB) and the top-k (one program), each costing more in launch
latency and ramp than in bytes. Here every program of a token adds and normalises that token's row itself (a few
KB from L2), then takes its own slice of the router's rows (read before the PDL wait: they depend on nothing
before), and the token's last program to finish, found by an arrival count, picks the experts from all the slices'
logits. The counts return to zero, so one buffer serves every layer and every graph replay.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def softmax_topk_row(
    logits, offs_e, weights_ptr, ids_ptr, t, EXPERTS: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr,
    RENORM: tl.constexpr,
):
    """Store the ``TOP_K`` largest softmax scores of ``logits`` (``[E_P2]`` float32, ``-inf`` past ``EXPERTS``)
    and their expert ids for token ``t``, best first, the lowest id first on ties."""
    p = tl.exp(logits - tl.max(logits, axis=0))
    score = p / tl.sum(p, axis=0)
    choice = tl.where(offs_e < EXPERTS, score, float("-inf"))
    offs_k = tl.arange(0, K_P2)
    chosen_w = tl.zeros([K_P2], dtype=tl.float32)
    chosen_i = tl.zeros([K_P2], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        e = tl.min(tl.where(choice == best, offs_e, EXPERTS), axis=0)
        w = tl.sum(tl.where(offs_e == e, score, 0.0), axis=0)
        chosen_w = tl.where(offs_k == j, w, chosen_w)
        chosen_i = tl.where(offs_k == j, e.to(tl.int64), chosen_i)
        choice = tl.where(offs_e == e, float("-inf"), choice)
    if RENORM:
        chosen_w = chosen_w / tl.sum(chosen_w, axis=0)
    tl.store(weights_ptr + t * TOP_K + offs_k, chosen_w, mask=offs_k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + offs_k, chosen_i, mask=offs_k < TOP_K)


@triton.jit
def add_norm_route_kernel(
    x_out_ptr, res_out_ptr, hidden_ptr, residual_ptr, norm_ptr, router_ptr, logits_ptr, arrivals_ptr,
    weights_ptr, ids_ptr, eps,
    stride_h, stride_r, stride_xo, stride_ro, stride_router,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, EXPERTS: tl.constexpr, E_P2: tl.constexpr,
    PER_PROGRAM: tl.constexpr, PROGRAMS: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr,
    RENORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program ``(t, p)``: token ``t``'s ``s = hidden + residual`` (rounded to the dtype) and ``x = rms_norm(s)``
    (program 0 stores both), the logits of experts ``[p * PER_PROGRAM, (p + 1) * PER_PROGRAM)`` (rounded to the
    model dtype, as a router product's output is); the token's last program stores its softmax top-k."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    rows = p * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    row_ok = rows < EXPERTS
    w_ptrs = router_ptr + rows[:, None].to(tl.int64) * stride_router + offs[None, :]
    if USE_PDL:
        gdc_launch_dependents()
        w = tl.load(w_ptrs, mask=row_ok[:, None] & mask[None, :], other=0.0)
        gdc_wait()
    else:
        w = tl.load(w_ptrs, mask=row_ok[:, None] & mask[None, :], other=0.0)
    h = tl.load(hidden_ptr + t * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    summed = (h + r).to(res_out_ptr.dtype.element_ty)
    s = summed.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, 0) / HIDDEN + eps)
    x = (s * inv * tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x_out_ptr.dtype.element_ty)
    if p == 0:
        tl.store(res_out_ptr + t * stride_ro + offs, summed, mask=mask)
        tl.store(x_out_ptr + t * stride_xo + offs, x, mask=mask)
    logit = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    logit = logit.to(x_out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + t * E_P2 + rows, logit, mask=row_ok)
    # release: this program's logits are visible to whichever program arrives last (acquire)
    arrived = tl.atomic_add(arrivals_ptr + t, 1, sem="acq_rel")
    if arrived == PROGRAMS - 1:
        offs_e = tl.arange(0, E_P2)
        every = tl.load(logits_ptr + t * E_P2 + offs_e, mask=offs_e < EXPERTS, other=float("-inf"),
                        cache_modifier=".cg")
        softmax_topk_row(every, offs_e, weights_ptr, ids_ptr, t, EXPERTS, TOP_K, K_P2, RENORM)
        tl.store(arrivals_ptr + t, 0)

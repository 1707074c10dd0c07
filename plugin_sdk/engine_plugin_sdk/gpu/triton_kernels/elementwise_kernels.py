"""Triton kernels for the small fused ops: RMSNorm (with residual add), LayerNorm, rotary embedding, SiLU-and-mul.

Every kernel computes in float32 and stores in the output's dtype; one program handles one row (one
token), so the launch grid is the number of tokens and the kernels need no vendor-specific tuning.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.pdl import pdl_begin


@triton.jit
def rms_norm_kernel(
    out_ptr, x_ptr, weight_ptr, eps,
    stride_x, stride_out,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_kernel(
    out_ptr, x_ptr, residual_ptr, weight_ptr, bias_ptr, eps,
    stride_x, stride_res, stride_out,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr = False,
):
    """``(x - mean) / sqrt(var + eps) * weight (+ bias)`` for one row, in float32 (biased variance); with
    ``HAS_RESIDUAL`` of ``x + residual``, the sum rounded to the dtype as the unfused sum would be."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
    x = x.to(tl.float32)
    # the padding lanes must not enter the variance: zero them after centring
    centred = tl.where(mask, x - tl.sum(x, 0) / HIDDEN, 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(centred * centred, 0) / HIDDEN + eps)
    y = centred * inv * tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fused_add_rms_norm_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """``s = x + residual`` (rounded to the dtype, as the unfused sum would be), then ``rms_norm(s)``."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    y = _add_rms_norm_row(residual_out_ptr, x_ptr, residual_ptr, weight_ptr, eps, row, offs, mask,
                          stride_x, stride_res, stride_res_out, HIDDEN)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def summed_row_rms(
    residual_out_ptr, x_ptr, residual_ptr, eps, row, offs, mask, store,
    stride_x, stride_res, stride_res_out, HIDDEN: tl.constexpr,
):
    """Store row ``x + residual`` (rounded to the residual's dtype) where ``store`` holds and return it in float32
    with the inverse of its root mean square: ``(s, inv)``, the RMS norm being ``s * inv * w`` (every norm that adds
    a residual takes its sum of squares from here, so their normalised rows agree bit for bit at one layout)."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
    summed = (x + r).to(residual_out_ptr.dtype.element_ty)
    tl.store(residual_out_ptr + row * stride_res_out + offs, summed, mask=store)
    s = summed.to(tl.float32)
    return s, 1.0 / tl.sqrt(tl.sum(s * s, 0) / HIDDEN + eps)


@triton.jit
def _add_rms_norm_row(
    residual_out_ptr, x_ptr, residual_ptr, weight_ptr, eps, row, offs, mask,
    stride_x, stride_res, stride_res_out, HIDDEN: tl.constexpr,
):
    """Store row ``x + residual`` (rounded to the residual's dtype) and return its RMS norm in float32."""
    s, inv = summed_row_rms(residual_out_ptr, x_ptr, residual_ptr, eps, row, offs, mask, mask, stride_x, stride_res,
                            stride_res_out, HIDDEN)  # fmt: skip
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return s * inv * w


@triton.jit
def _rotate_heads(ptr, stride_tok, stride_head, stride_dim, tok, cos, sin, offs_h, offs_r,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr):
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_r[None, :] < HALF)
    base = ptr + tok * stride_tok + offs_h[:, None] * stride_head + offs_r[None, :] * stride_dim
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF * stride_dim, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF * stride_dim, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


# the positions are a slice of the step's packed inputs, aligned or not by the batch's make-up
@triton.jit(do_not_specialize=["positions_ptr"])
def rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_q_tok, stride_q_head, stride_q_dim, stride_k_tok, stride_k_head, stride_k_dim, stride_cs,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    H_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Rotate-half rotary embedding of one token's query and key heads, in place."""
    pdl_begin(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_r = tl.arange(0, HALF_PAD)
    r_ok = offs_r < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_r, mask=r_ok, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_r, mask=r_ok, other=0.0)[None, :]
    _rotate_heads(q_ptr, stride_q_tok, stride_q_head, stride_q_dim, tok, cos, sin, tl.arange(0, H_PAD), offs_r,
                  NUM_HEADS, HALF)
    _rotate_heads(k_ptr, stride_k_tok, stride_k_head, stride_k_dim, tok, cos, sin, tl.arange(0, KV_PAD), offs_r,
                  NUM_KV_HEADS, HALF)


#: the ``ACT`` of :func:`gated_activation_kernel`: SwiGLU or GeGLU with the tanh GELU
SILU = 0
GELU_TANH = 1
# a kernel may read a global only as a constexpr
_GELU_TANH = tl.constexpr(GELU_TANH)


@triton.jit
def gated_product(gate, up, ACT: tl.constexpr):
    """``act(gate) * up`` on float32 values (shared with the gated GEMV's epilogue)."""
    if ACT == _GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        # tanh(u) = 1 - 2 / (exp(2u) + 1): exact at both tails (exp overflows to inf, giving 1)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        return 0.5 * gate * (1.0 + tanh) * up
    else:
        return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def gated_activation_kernel(
    out_ptr, x_ptr, stride_x, stride_out,
    D: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr, USE_PDL: tl.constexpr,
):
    """``act(x[:, :D]) * x[:, D:]`` for one row and one column tile, in float32: SwiGLU (``ACT`` =
    :data:`SILU`) or GeGLU with the tanh GELU (:data:`GELU_TANH`)."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    result = gated_product(gate, up, ACT)
    tl.store(out_ptr + row * stride_out + offs, result.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantize_rows_fp8_kernel(
    out_ptr, scale_ptr, x_ptr, stride_x, stride_out,
    K: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One row to FP8 with its own scale ``max |x| / FP8_MAX`` (the W8A8 GEMM's activations), one pass."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    _store_fp8_row(out_ptr, scale_ptr, row, stride_out, offs, mask, x, FP8_MAX)


@triton.jit
def _store_fp8_row(out_ptr, scale_ptr, row, stride_out, offs, mask, y, FP8_MAX: tl.constexpr):
    """Row ``y`` (float32, padding lanes zero) as FP8 with its scale ``max |y| / FP8_MAX``."""
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(y), 0), FP8_MAX), 1.0e-12)
    # a product by the reciprocal, as torch's GPU kernels do, not an IEEE quotient per value: that
    # division made the quantizer compute-bound at half the bandwidth (H200, 16384 x 14336: 163 against
    # 313 us); values on an FP8 rounding midpoint (~0.04%) may round the other way
    q = tl.minimum(tl.maximum(y * tl.div_rn(1.0, scale), -FP8_MAX), FP8_MAX)
    tl.store(out_ptr + row * stride_out + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def fused_add_rms_norm_fp8_kernel(
    out_ptr, scale_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr,
):
    """:func:`fused_add_rms_norm_kernel` whose normalised row is written as FP8 with its scale (the W8A8
    GEMM's input). The row is rounded to the activation dtype first, so the values match the unfused
    norm followed by the quantizer."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    y = _add_rms_norm_row(residual_out_ptr, x_ptr, residual_ptr, weight_ptr, eps, row, offs, mask,
                          stride_x, stride_res, stride_res_out, HIDDEN)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_fp8_row(out_ptr, scale_ptr, row, stride_out, offs, mask, y, FP8_MAX)


@triton.jit
def silu_and_mul_fp8_kernel(
    out_ptr, scale_ptr, x_ptr, stride_x, stride_out,
    D: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr,
):
    """``silu(x[:, :D]) * x[:, D:]`` for one whole row, written as FP8 with its scale (rounded to the
    activation dtype first, as the unfused product followed by the quantizer)."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_fp8_row(out_ptr, scale_ptr, row, stride_out, offs, mask, y, FP8_MAX)


@triton.jit
def _greedy_scan(row_ptr, lo, hi, vocab_size, BLOCK: tl.constexpr):
    """Over columns ``[lo, hi)`` of one row: the first maximum's column, the maximum, and the sum of
    ``exp(x - max)`` (a running max and sum, rescaled when the max grows; an all ``-inf`` range gives
    ``-inf`` and a sum of 0, not NaN)."""
    offs0 = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    best = tl.sum(tl.zeros([BLOCK], tl.int64), 0) + lo
    for start in range(lo, hi, BLOCK):
        offs = start + offs0
        x = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, 0)
        # the first position of the chunk's max; a later chunk takes over only with a strictly larger one
        chunk_best = tl.min(tl.where(x == chunk_max, offs, vocab_size), 0).to(tl.int64)
        best = tl.where(chunk_max > m, chunk_best, best)
        m_new = tl.maximum(m, chunk_max)
        # while everything seen is -inf, exp(-inf - -inf) would be NaN: shift by 0 instead
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
        m = m_new
    return best, m, total


@triton.jit
def greedy_pick_kernel(
    ids_ptr, logprob_ptr, logits_ptr, stride_row, vocab_size,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One row's first maximum over ``[0, vocab_size)`` and its log-softmax value, in one pass with a
    running max and a running sum of exponentials (rescaled when the max grows)."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    best, m, total = _greedy_scan(logits_ptr + row * stride_row, 0, vocab_size, vocab_size, BLOCK)
    tl.store(ids_ptr + row, best)
    tl.store(logprob_ptr + row, -tl.log(total))


@triton.jit
def greedy_pick_partial_kernel(
    part_best_ptr, part_m_ptr, part_sum_ptr, logits_ptr, stride_row, vocab_size,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """:func:`greedy_pick_kernel` over one ``CHUNK`` of columns of one row (a row's chunks in parallel:
    at small batches one program per row left most of the GPU idle); :func:`greedy_pick_merge_kernel`
    joins the partials ``[rows, chunks]``."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, vocab_size)
    best, m, total = _greedy_scan(logits_ptr + row * stride_row, lo, hi, vocab_size, BLOCK)
    part = row * tl.num_programs(1) + chunk
    tl.store(part_best_ptr + part, best)
    tl.store(part_m_ptr + part, m)
    tl.store(part_sum_ptr + part, total)


@triton.jit
def greedy_pick_merge_kernel(
    ids_ptr, logprob_ptr, part_best_ptr, part_m_ptr, part_sum_ptr, num_chunks, vocab_size,
    CHUNKS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One row's partials: the earliest chunk holding the global maximum gives the token (so ties go to
    the first column, as in one pass), and the chunks' sums rescaled to that maximum give its log-softmax."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    ok = offs < num_chunks
    part = row * num_chunks + offs
    m = tl.load(part_m_ptr + part, mask=ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part, mask=ok, other=0.0)
    bests = tl.load(part_best_ptr + part, mask=ok, other=0)
    m_max = tl.max(m, 0)
    best = tl.min(tl.where(ok & (m == m_max), bests, vocab_size), 0)
    shift = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.sum(sums * tl.exp(m - shift), 0)
    tl.store(ids_ptr + row, best.to(tl.int64))
    tl.store(logprob_ptr + row, -tl.log(total))

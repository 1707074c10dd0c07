"""The second half of split-context decode attention: joining each head's splits (flash-decoding's merge),
as its own kernel or from the decode kernel's last split (``MERGE_LAST``, see ``decode_attention_kernels``)."""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def split_share(seq_len, window, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
                MIN_SHARE: tl.constexpr = 0):
    """How a sequence's context is cut across the decode kernel's splits: ``(lo, span, per_split)``, the
    first key any split reads, the keys they read in all, and each split's share (whole ``BLOCK_N`` tiles, at
    least ``MIN_SHARE`` keys: a short context then takes fewer splits, the rest holding none). The decode kernel
    and the merge both take it from here, so they agree on which splits hold keys."""
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, seq_len - window)
    span = seq_len - lo
    per_split = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    if MIN_SHARE > BLOCK_N:
        per_split = tl.maximum(per_split, MIN_SHARE)
    return lo, span, per_split


@triton.jit
def _merge_head(
    out_ptr, part_acc_ptr, part_ml_ptr, seq, head, num_heads, stride_o_tok, stride_o_head,
    used, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    """Join the first ``used`` splits of one head of one sequence (the others are empty: not read):
    rescale each by exp(m_s - max m) and normalise."""
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < used
    part = (seq * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.maximum(denom, 1.0e-30)
    tl.store(
        out_ptr + seq * stride_o_tok + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@triton.jit
def decode_merge_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, seq_lens_ptr, window,
    stride_o_tok, stride_o_head,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_PDL: tl.constexpr, MIN_SHARE: tl.constexpr = 0,
):
    """Join the splits of one head of one sequence (see :func:`_merge_head`): only those that
    :func:`.decode_attention_kernels.paged_decode_kernel` (launched with ``BLOCK_N``, ``MIN_SHARE`` and ``SKIP_IDLE``) gave
    keys, and split 0."""
    if USE_PDL:
        gdc_launch_dependents()
    seq = tl.program_id(0).to(tl.int64)
    # the context lengths are copied in before the step (no kernel of it writes them): read while the decode
    # kernel drains, so that after the wait the partials are the one memory round trip
    seq_len = tl.load(seq_lens_ptr + seq)
    if USE_PDL:
        gdc_wait()
    _, span, per_split = split_share(seq_len, window, NUM_SPLITS, BLOCK_N, USE_WINDOW, MIN_SHARE)
    used = tl.maximum(tl.cdiv(span, tl.maximum(per_split, 1)), 1)
    _merge_head(out_ptr, part_acc_ptr, part_ml_ptr, seq, tl.program_id(1),
                tl.num_programs(1), stride_o_tok, stride_o_head, used, NUM_SPLITS, HEAD_DIM, D_PAD)


@triton.jit
def merge_heads_from_l2(
    out_ptr, part_acc_ptr, part_ml_ptr, seq, first_head, num_heads, stride_o_tok, stride_o_head, used,
    HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    """:func:`_merge_head` for ``HEADS`` heads from ``first_head`` at once, as the decode kernel's last split to
    arrive runs it (``MERGE_LAST``): every head's running maxima and sums, and the first ``CHUNK`` splits'
    accumulators, in one round of loads from L2 (``.cg``: other programs of the launch wrote them). Why: a loop
    over the heads stores each head's row before the next head's loads, which the compiler may not move above
    that store, so the heads' L2 round trips ran one after another (Qwen3-30B-A3B's 8 heads a KV head: 13% of
    an H100's batch-1 decode, 2026-12-07). Splits past ``CHUNK`` (long contexts) come a chunk a round."""
    V: tl.constexpr = HEADS - 1
    H_PAD: tl.constexpr = (V | (V >> 1) | (V >> 2) | (V >> 3) | (V >> 4) | (V >> 5) | (V >> 6)) + 1
    CHUNK: tl.constexpr = 8 if NUM_SPLITS > 8 else NUM_SPLITS
    offs_h = tl.arange(0, H_PAD)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, D_PAD)
    h_ok = offs_h < HEADS
    base = (seq * num_heads + first_head + offs_h) * NUM_SPLITS
    ml_at = (base[:, None] + offs_s[None, :]) * 2
    ml_ok = h_ok[:, None] & (offs_s[None, :] < used)
    m = tl.load(part_ml_ptr + ml_at, mask=ml_ok, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(part_ml_ptr + ml_at + 1, mask=ml_ok, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.sum(tl.exp2(m - m_max[:, None]) * l_s, 1)
    out = tl.zeros((H_PAD, D_PAD), dtype=tl.float32)
    for c0 in range(0, used, CHUNK):
        split = c0 + offs_c
        ok = h_ok[:, None] & (split[None, :] < used)
        part = base[:, None] + split[None, :]
        m_c = tl.load(part_ml_ptr + part * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
        acc = tl.load(part_acc_ptr + (part * D_PAD)[:, :, None] + offs_d[None, None, :], mask=ok[:, :, None],
                      other=0.0, cache_modifier=".cg")  # fmt: skip
        out += tl.sum(acc * tl.exp2(m_c - m_max[:, None])[:, :, None], 1)
    out = out / tl.maximum(denom, 1.0e-30)[:, None]
    heads = first_head + offs_h
    tl.store(
        out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
    )

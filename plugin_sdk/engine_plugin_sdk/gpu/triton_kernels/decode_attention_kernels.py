"""Split-context decode attention over the paged cache (flash-decoding), one new token a sequence.

A program takes one or two KV heads of one sequence over one share of its context. With two
(``KV_HEADS``), the query rows of both heads' groups fill the tile the tensor cores take (16 rows: a group
of 4 query heads alone pads 12), and the product with each head's keys runs over a copy of the query whose
other head's rows are zero: the same products as two programs, but the softmax, the masks and the
block-table reads once for both. Over an FP8 cache those, not the bytes, bound the kernel.

Cache layout and softmax as in :mod:`.attention_kernels`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.attention_kernels import (
    BATCH_VARYING_ARGS,
    _dot,
    _dot_operand,
    _soft_cap,
)
from engine_plugin_sdk.gpu.triton_kernels.decode_merge_kernels import merge_heads_from_l2, split_share
from engine_plugin_sdk.gpu.triton_kernels.l2_prefetch import ask_l2_share
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _kv_tiles(
    cache_ptr, block_table_ptr, offs_n, seq_len, kv_head, offs_d, stride_slot, stride_head,
    KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, KV_HEADS: tl.constexpr,
):  # fmt: skip
    """Keys (or values) ``[BLOCK_N, D_PAD]`` of context positions ``offs_n`` of one sequence for KV head
    ``kv_head`` and, with two ``KV_HEADS``, the next one (else the first again), through one block-table read."""
    at, mask = _tile_offsets(block_table_ptr, offs_n, seq_len, kv_head, offs_d, stride_slot, stride_head, KV_BLOCK,
                             HEAD_DIM)  # fmt: skip
    first = tl.load(cache_ptr + at, mask=mask, other=0.0)
    second = first
    if KV_HEADS == 2:
        second = tl.load(cache_ptr + at + stride_head, mask=mask, other=0.0)
    return first, second


@triton.jit
def _tile_offsets(block_table_ptr, offs_n, seq_len, kv_head, offs_d, stride_slot, stride_head, KV_BLOCK: tl.constexpr,
                  HEAD_DIM: tl.constexpr):  # fmt: skip
    """Cache offsets ``[BLOCK_N, D_PAD]`` of context positions ``offs_n`` of one sequence for KV head ``kv_head`` (the
    next head's are ``stride_head`` on), and their load mask."""
    valid = offs_n < seq_len
    block = tl.load(block_table_ptr + offs_n // KV_BLOCK, mask=valid, other=0).to(tl.int64)
    slot = block * KV_BLOCK + (offs_n % KV_BLOCK)
    at = slot[:, None] * stride_slot + kv_head * stride_head + offs_d[None, :]
    mask = valid[:, None]
    if HEAD_DIM != offs_d.shape[0]:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    return at, mask


@triton.jit
def _rotation(rot_index_ptr, rot_table_ptr, seq, stride_rot, offs_d, d_ok, HEAD_DIM: tl.constexpr):
    """Per dim of a head: cos and sin of sequence ``seq``'s position, the rotate-half partner dim and
    the partner's sign (``x' = x * cos + sign * x[partner] * sin``)."""
    half: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(rot_index_ptr + seq).to(tl.int64)
    first = offs_d < half
    within = tl.where(first, offs_d, offs_d - half)
    cos = tl.load(rot_table_ptr + pos * stride_rot + within, mask=d_ok, other=1.0)
    sin = tl.load(rot_table_ptr + pos * stride_rot + half + within, mask=d_ok, other=0.0)
    partner = tl.where(first, offs_d + half, offs_d - half)
    partner = tl.where(d_ok, partner, 0)
    sign = tl.where(first, -1.0, 1.0)
    return cos, sin, partner, sign


@triton.jit
def _norm_weights(weight_ptr, offs_d, partner, d_ok):
    """A head norm's float32 scales ``[D_PAD]`` per dim and at each dim's rotation partner."""
    w = tl.load(weight_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    return w, tl.load(weight_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)


@triton.jit
def _head_constants(rot_index_ptr, rot_table_ptr, q_norm_ptr, k_norm_ptr, seq, stride_rot, offs_d, d_ok,
                    HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, HEAD_NORM: tl.constexpr):  # fmt: skip
    """What rotating and normalising the step's query and key read besides them: :func:`_rotation`'s values (stand-ins
    where nothing rotates: unread) and the query's and key's head-norm scales (:func:`_norm_weights`; the query's
    again where there is no norm: unread). None of it is written by the step's kernels."""
    cos = tl.zeros([offs_d.shape[0]], dtype=tl.float32)
    sin, sign, partner = cos, cos, offs_d
    if ROTARY:
        cos, sin, partner, sign = _rotation(rot_index_ptr, rot_table_ptr, seq, stride_rot, offs_d, d_ok, HEAD_DIM)
    q_w, q_w_partner = cos, cos
    k_w, k_w_partner = cos, cos
    if HEAD_NORM:
        q_w, q_w_partner = _norm_weights(q_norm_ptr, offs_d, partner, d_ok)
        k_w, k_w_partner = _norm_weights(k_norm_ptr, offs_d, partner, d_ok)
    return cos, sin, partner, sign, q_w, q_w_partner, k_w, k_w_partner


@triton.jit
def _head_norm(x, x_partner, w, w_partner, eps, HEAD_DIM: tl.constexpr):
    """Rows ``x`` ``[rows, D_PAD]`` (masked dims zero) and their rotation partners, RMS-normalised by each
    row's own statistic and scaled per dim (``w``, ``w_partner``: :func:`_norm_weights`), rounded back to x's
    dtype as the norm kernel stores them."""
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / HEAD_DIM + eps)
    normed = (xf * inv[:, None] * w[None, :]).to(x.dtype)
    normed_partner = (x_partner.to(tl.float32) * inv[:, None] * w_partner[None, :]).to(x.dtype)
    return normed, normed_partner


@triton.jit
def _online_softmax(qk, offs_n, kv_end, q_pos, window, scale, soft_cap, qk_scale, m_i, l_i, USE_WINDOW: tl.constexpr,
                    USE_CAP: tl.constexpr, PRESCALED: tl.constexpr):  # fmt: skip
    """One tile's raw scores ``qk`` (positions ``offs_n``, those from ``kv_end`` on masked) folded into the running
    max ``m_i`` and sum ``l_i``: the new ones, the old max's rescale ``alpha`` and the tile's weights ``p``.
    ``PRESCALED``: the query held ``qk_scale`` already."""
    if USE_CAP:
        qk = _soft_cap(qk * scale, soft_cap) * 1.4426950408889634
    elif not PRESCALED:
        qk = qk * qk_scale
    visible = offs_n[None, :] < kv_end
    if USE_WINDOW:
        visible = visible & (offs_n[None, :] > q_pos - window)
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _head_values(acc, p, pair, v, SECOND: tl.constexpr, dtype: tl.constexpr, IS_FP32: tl.constexpr,
                 KV_HEADS: tl.constexpr):  # fmt: skip
    """``acc`` plus the weights ``p`` of one KV head's rows (with two ``KV_HEADS``: where ``pair`` is set for the
    ``SECOND``, elsewhere for the first) times that head's values ``v``."""
    if KV_HEADS == 2:
        p = tl.where(pair[:, None] == SECOND, p, 0.0)
    return _dot_acc(p.to(dtype), v.to(dtype), acc, IS_FP32)


@triton.jit
def _dot_acc(a, b, acc, IS_FP32: tl.constexpr):
    """``acc + a @ b``, accumulated by the product itself (no separate add of its result)."""
    if IS_FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _new_kv(
    new_k_ptr, new_v_ptr, k_cache_ptr, v_cache_ptr, slot, row, kv_head, offs_d, own_d, partner, cos, sin, sign,
    k_w, k_w_partner, norm_eps, stride_nk_tok, stride_nk_head, stride_nv_tok, stride_nv_head, stride_slot,
    stride_kv_head, D_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, HEAD_NORM: tl.constexpr,
):  # fmt: skip
    """The step's key and value of one KV head (rotated, and normalised first with ``HEAD_NORM``), stored at
    ``slot`` (skipped when negative) where ``own_d`` says the program holds the last position, and returned
    as the cache holds them ``[D_PAD]``."""
    k_new = tl.load(new_k_ptr + row * stride_nk_tok + kv_head * stride_nk_head + offs_d, mask=own_d, other=0.0)
    if ROTARY:
        k_partner = tl.load(new_k_ptr + row * stride_nk_tok + kv_head * stride_nk_head + partner, mask=own_d, other=0.0)
        if HEAD_NORM:
            k_new, k_partner = _head_norm(k_new[None, :], k_partner[None, :], k_w, k_w_partner, norm_eps, HEAD_DIM)
            k_new, k_partner = tl.reshape(k_new, (D_PAD,)), tl.reshape(k_partner, (D_PAD,))
        k_rot = k_new.to(tl.float32) * cos + sign * k_partner.to(tl.float32) * sin
        k_new = k_rot.to(new_k_ptr.dtype.element_ty)
    v_new = tl.load(new_v_ptr + row * stride_nv_tok + kv_head * stride_nv_head + offs_d, mask=own_d, other=0.0)
    # what the cache holds, then what the loop would have read from it
    k_new = k_new.to(k_cache_ptr.dtype.element_ty)
    v_new = v_new.to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + slot * stride_slot + kv_head * stride_kv_head + offs_d, k_new, mask=own_d & (slot >= 0))
    tl.store(v_cache_ptr + slot * stride_slot + kv_head * stride_kv_head + offs_d, v_new, mask=own_d & (slot >= 0))
    return k_new, v_new


@triton.jit(do_not_specialize=BATCH_VARYING_ARGS, do_not_specialize_on_alignment=BATCH_VARYING_ARGS)
def paged_decode_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, arrivals_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    new_k_ptr, new_v_ptr, slot_ptr, sinks_ptr, rot_index_ptr, rot_table_ptr, q_norm_ptr, k_norm_ptr,
    scale, soft_cap, window, norm_eps,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_bt, stride_slot, stride_kv_head,
    stride_nk_tok, stride_nk_head, stride_nv_tok, stride_nv_head, stride_rot,
    NUM_QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr, IS_FP32: tl.constexpr, WRITE_KV: tl.constexpr,
    DOT_F16: tl.constexpr, USE_PDL: tl.constexpr, USE_SINKS: tl.constexpr, ROTARY: tl.constexpr,
    HEAD_NORM: tl.constexpr, MERGE_LAST: tl.constexpr, EARLY_KV: tl.constexpr = True,
    SKIP_IDLE: tl.constexpr = False, KV_HEADS: tl.constexpr = 1, PRESCALED: tl.constexpr = False,
    MIN_SHARE: tl.constexpr = 0, l2_ptr=None, l2_lines=0, L2_LINES: tl.constexpr = 0, L2_ASM: tl.constexpr = False,
):
    """One program: every query head of ``KV_HEADS`` (1 or 2) consecutive KV heads of one sequence (one new
    token each), over one contiguous share of the context (flash-decoding). Keys are read once for each head
    group; ``GROUP_PAD`` covers ``KV_HEADS * NUM_QUERIES_PER_KV`` query rows.

    With one split the normalised result goes straight to ``out``; otherwise the unnormalised
    accumulator and its running max / sum go to the partial buffers for :func:`.decode_merge_kernels.decode_merge_kernel`; with
    ``MERGE_LAST`` each program counts itself in ``arrivals[seq, program]`` (int32, zero before the launch)
    and the last of the splits to arrive merges the group's heads itself and sets the count back to zero:
    one launch fewer per layer. Rows with ``seq_len == 0`` (graph padding) produce zeros.

    ``WRITE_KV``: the new token's key and value (``new_k`` / ``new_v``, row ``seq``) are not in the cache
    yet. The program whose share holds the last position stores them at ``slot`` (skipped when negative)
    and attends to them from registers; every program reads the cache only below the last position, so
    no program reads what another writes.

    ``USE_SINKS``: split 0 starts its running softmax from each head's sink (a sum of one, no value), so
    the merge counts the sink once.

    ``ROTARY`` (with ``WRITE_KV``): the query and the new key arrive unrotated; each program rotates them
    (rotate-half over the whole head, by row ``rot_index[seq]`` of the ``[rows, cos | sin]`` table), each
    rounded to its input dtype as the rotary kernel would store it, and the key is cached rotated.

    ``HEAD_NORM`` (with ``ROTARY``): before rotating, each head's query row and the new key are
    RMS-normalised over the head (``q_norm`` / ``k_norm`` scales, float32, rounded to the input dtype as
    the norm kernel stores them): a dim's rotation partner is normalised by the same row statistic.

    ``SKIP_IDLE`` (several splits): a split past the end of its sequence's context writes no partials and ends at
    once; the merge (its kernel, or with ``MERGE_LAST`` the last split to arrive of those that hold keys) reads
    only those that do.

    ``MIN_SHARE``: no split takes fewer than this many keys (a multiple of ``BLOCK_N``; 0: one tile), so that a
    short context in a graph captured for any length is read by the few splits it needs, not by as many one-tile
    splits as it has tiles (:func:`.decode_merge_kernels.split_share`).

    Under PDL with ``WRITE_KV`` (and ``EARLY_KV``) a program reads its context length, block table and
    first key and value tiles before it waits for the kernel that wrote the query: none of them is written
    by this step's kernels (the lengths and tables are copied in before the step, the cached positions by
    earlier steps, and this step's own key and value arrive in ``new_k`` / ``new_v``), so the cache reads
    overlap that kernel's tail instead of following it. Without ``WRITE_KV`` an earlier kernel of the step
    may have written the cache, so everything waits.

    ``PRESCALED`` (no soft cap): the query is multiplied by the scores' scale once, in its own dtype, instead of
    every tile's scores (the launcher asks it over an FP8 cache and in float32).

    ``L2_LINES`` (an experiment, off unless a benchmark asks): once past its wait, each program asks the L2 cache for
    its share of the ``l2_lines`` 128-byte lines at ``l2_ptr`` (bytes), ``L2_LINES`` each (the idle splits wait to
    ask for theirs): the weight the next GEMV reads, fetched while this latency-bound kernel leaves the memory idle.
    ``L2_ASM`` off (the interpreter) asks for nothing; no result depends on it.
    """
    early: tl.constexpr = USE_PDL and WRITE_KV and EARLY_KV
    if USE_PDL:
        gdc_launch_dependents()
        if not early:
            gdc_wait()
    if L2_LINES > 0 and not early:
        ask_l2_share(l2_ptr, l2_lines, L2_LINES, L2_ASM)
    # KV heads vary fastest across programs: a token's heads sit side by side in the cache, so the
    # programs running together read whole cache rows rather than one head's slice of many rows (which
    # halved the DRAM efficiency of an FP8 cache, whose slices are half as long)
    kv_head = tl.program_id(0) * KV_HEADS  # the program's first KV head
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n0 = tl.arange(0, BLOCK_N)
    heads = kv_head * NUM_QUERIES_PER_KV + offs_g
    g_ok = offs_g < NUM_QUERIES_PER_KV * KV_HEADS
    pair = offs_g >= NUM_QUERIES_PER_KV  # the second KV head's rows
    d_ok = offs_d < HEAD_DIM
    row = seq.to(tl.int64)
    lo, span, per_split = split_share(seq_len, window, NUM_SPLITS, BLOCK_N, USE_WINDOW, MIN_SHARE)
    start = lo + split * per_split
    if SKIP_IDLE:
        # a graph's split count is fixed for any context: the splits past a short one's end have nothing to
        # do, and the merge does not read them; they leave at once (before any wait: split 0 always waits,
        # so the launch still ends after its predecessor)
        if (split > 0) & (start >= seq_len):
            if L2_LINES > 0 and early:
                gdc_wait()
                ask_l2_share(l2_ptr, l2_lines, L2_LINES, L2_ASM)
            return
    end = tl.minimum(start + per_split, seq_len)
    q_pos = seq_len - 1
    # with WRITE_KV the last position comes from new_k / new_v, not from the cache
    cached_end = end
    if WRITE_KV:
        cached_end = tl.minimum(end, q_pos)
    bt_ptr = block_tables_ptr + row * stride_bt
    if early:
        # the first tile, before the wait (see above); the loop below takes the rest. Only here: a tile held in
        # registers through the query's arrival costs a large batch's programs registers they need more
        k_first, k1_first = _kv_tiles(k_cache_ptr, bt_ptr, start + offs_n0, cached_end, kv_head, offs_d,
                                      stride_slot, stride_kv_head, KV_BLOCK, HEAD_DIM, KV_HEADS)
        v_first, v1_first = _kv_tiles(v_cache_ptr, bt_ptr, start + offs_n0, cached_end, kv_head, offs_d,
                                      stride_slot, stride_kv_head, KV_BLOCK, HEAD_DIM, KV_HEADS)
        # and the rotation's position and table row (two dependent reads) and the norms' scales, so that after
        # the wait the query's read is the one memory round trip before the products
        cos, sin, partner, sign, q_w, q_w_partner, k_w, k_w_partner = _head_constants(
            rot_index_ptr, rot_table_ptr, q_norm_ptr, k_norm_ptr, seq, stride_rot, offs_d, d_ok, HEAD_DIM, ROTARY,
            HEAD_NORM)  # fmt: skip
        gdc_wait()
        if L2_LINES > 0:
            ask_l2_share(l2_ptr, l2_lines, L2_LINES, L2_ASM)
    else:
        cos, sin, partner, sign, q_w, q_w_partner, k_w, k_w_partner = _head_constants(
            rot_index_ptr, rot_table_ptr, q_norm_ptr, k_norm_ptr, seq, stride_rot, offs_d, d_ok, HEAD_DIM, ROTARY,
            HEAD_NORM)  # fmt: skip
    q = tl.load(
        q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if ROTARY:
        q_partner = tl.load(
            q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head + partner[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if HEAD_NORM:
            q, q_partner = _head_norm(q, q_partner, q_w, q_w_partner, norm_eps, HEAD_DIM)
        rotated = q.to(tl.float32) * cos[None, :] + sign[None, :] * q_partner.to(tl.float32) * sin[None, :]
        q = rotated.to(q_ptr.dtype.element_ty)

    q = _dot_operand(q, DOT_F16)

    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    if USE_SINKS:
        # the split index broadcast by hand: a scalar condition in a where trips Triton's interpreter
        first = (offs_g * 0 + split) == 0
        sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634
    if WRITE_KV:
        # the step's own key and value first: what it needs (the rotation, the slot) is then dead before the tiles'
        # loop instead of held in registers through it
        # scalar conditions broadcast by hand: a scalar boolean in a mask trips Triton's interpreter
        pos_d = offs_d * 0 + q_pos
        own_d = (pos_d >= start) & (pos_d < end) & d_ok
        slot = tl.load(slot_ptr + seq + offs_d * 0).to(tl.int64)
        k_new, v_new = _new_kv(new_k_ptr, new_v_ptr, k_cache_ptr, v_cache_ptr, slot, row, kv_head, offs_d, own_d,
                               partner, cos, sin, sign, k_w, k_w_partner, norm_eps, stride_nk_tok, stride_nk_head,
                               stride_nv_tok, stride_nv_head, stride_slot, stride_kv_head, D_PAD, HEAD_DIM, ROTARY,
                               HEAD_NORM)  # fmt: skip
        k_rows = k_new[None, :]
        v_rows = v_new[None, :]
        if KV_HEADS == 2:
            k_next, v_next = _new_kv(new_k_ptr, new_v_ptr, k_cache_ptr, v_cache_ptr, slot, row, kv_head + 1, offs_d,
                                     own_d, partner, cos, sin, sign, k_w, k_w_partner, norm_eps, stride_nk_tok,
                                     stride_nk_head, stride_nv_tok, stride_nv_head, stride_slot, stride_kv_head, D_PAD,
                                     HEAD_DIM, ROTARY, HEAD_NORM)  # fmt: skip
            # each row its own head's key and value
            k_rows = tl.where(pair[:, None], k_next[None, :], k_rows)
            v_rows = tl.where(pair[:, None], v_next[None, :], v_rows)
        qk1 = tl.sum(q.to(tl.float32) * k_rows.to(q.dtype).to(tl.float32), 1)
        if USE_CAP:
            qk1 = _soft_cap(qk1 * scale, soft_cap) * 1.4426950408889634
        else:
            qk1 = qk1 * qk_scale
        pos_g = offs_g * 0 + q_pos
        qk1 = tl.where((pos_g >= start) & (pos_g < end), qk1, float("-inf"))
        m_new = tl.maximum(m_i, qk1)
        alpha = tl.exp2(m_i - m_new)
        p1 = tl.exp2(qk1 - m_new)
        l_i = l_i * alpha + p1
        acc = acc * alpha[:, None] + p1[:, None] * v_rows.to(q.dtype).to(tl.float32)
        m_i = m_new
    if PRESCALED:
        # the scores' scale on the query once, not on every tile's scores (the launcher says where that costs no
        # precision that matters)
        q = (q.to(tl.float32) * qk_scale).to(q.dtype)
    q0, q1 = q, q
    if KV_HEADS == 2:
        q0 = tl.where(pair[:, None], 0.0, q).to(q.dtype)
        q1 = tl.where(pair[:, None], q, 0.0).to(q.dtype)
    tiles_from = start
    if early:
        # a tile past cached_end is all masked: it leaves the running max, sum and accumulator as they are
        qk = _dot(q0, tl.trans(k_first.to(q0.dtype)), IS_FP32)
        if KV_HEADS == 2:
            qk = _dot_acc(q1, tl.trans(k1_first.to(q1.dtype)), qk, IS_FP32)
        m_i, l_i, alpha, p = _online_softmax(qk, start + offs_n0, cached_end, q_pos, window, scale, soft_cap, qk_scale,
                                             m_i, l_i, USE_WINDOW, USE_CAP, PRESCALED)  # fmt: skip
        acc = _head_values(acc * alpha[:, None], p, pair, v_first, False, q.dtype, IS_FP32, KV_HEADS)
        if KV_HEADS == 2:
            acc = _head_values(acc, p, pair, v1_first, True, q.dtype, IS_FP32, KV_HEADS)
        tiles_from = start + BLOCK_N
    for start_n in range(tiles_from, cached_end, BLOCK_N):
        offs_n = start_n + offs_n0
        # each head's tile read just before its product: both heads' tiles at once held about 50 registers more
        at, mask = _tile_offsets(bt_ptr, offs_n, cached_end, kv_head, offs_d, stride_slot, stride_kv_head, KV_BLOCK,
                                 HEAD_DIM)  # fmt: skip
        qk = _dot(q0, tl.trans(tl.load(k_cache_ptr + at, mask=mask, other=0.0).to(q0.dtype)), IS_FP32)
        if KV_HEADS == 2:
            k1 = tl.load(k_cache_ptr + at + stride_kv_head, mask=mask, other=0.0)
            qk = _dot_acc(q1, tl.trans(k1.to(q1.dtype)), qk, IS_FP32)
        m_i, l_i, alpha, p = _online_softmax(qk, offs_n, cached_end, q_pos, window, scale, soft_cap, qk_scale, m_i, l_i,
                                             USE_WINDOW, USE_CAP, PRESCALED)  # fmt: skip
        acc = _head_values(acc * alpha[:, None], p, pair, tl.load(v_cache_ptr + at, mask=mask, other=0.0), False,
                           q.dtype, IS_FP32, KV_HEADS)  # fmt: skip
        if KV_HEADS == 2:
            v1 = tl.load(v_cache_ptr + at + stride_kv_head, mask=mask, other=0.0)
            acc = _head_values(acc, p, pair, v1, True, q.dtype, IS_FP32, KV_HEADS)
    if NUM_SPLITS == 1:
        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(
            out_ptr + row * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )
    else:
        # partials: acc [seqs, heads, splits, D_PAD], (m, l) [seqs, heads, splits, 2]
        num_heads = tl.num_programs(0) * NUM_QUERIES_PER_KV * KV_HEADS
        part = (row * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], acc, mask=g_ok[:, None])
        # an empty split reports m = -inf so that the merge gives it no weight
        m_out = tl.where(l_i > 0.0, m_i, float("-inf"))
        tl.store(part_ml_ptr + part * 2, m_out, mask=g_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)
        if MERGE_LAST:
            # every thread's partials are stored before the count (acquire-release at GPU scope) says so
            tl.debug_barrier()
            count = arrivals_ptr + row * tl.num_programs(0) + tl.program_id(0)
            # a graph's split count is fixed for any context: only the first splits of a short one hold keys,
            # and with SKIP_IDLE only those (split 0 at least) arrive
            used = tl.maximum((span + per_split - 1) // tl.maximum(per_split, 1), 1)
            if tl.atomic_add(count, 1) == (used if SKIP_IDLE else NUM_SPLITS) - 1:
                merge_heads_from_l2(out_ptr, part_acc_ptr, part_ml_ptr, row, kv_head * NUM_QUERIES_PER_KV, num_heads,
                                    stride_o_tok, stride_o_head, used, NUM_QUERIES_PER_KV * KV_HEADS, NUM_SPLITS,
                                    HEAD_DIM, D_PAD)  # fmt: skip
                tl.atomic_xchg(count, 0)



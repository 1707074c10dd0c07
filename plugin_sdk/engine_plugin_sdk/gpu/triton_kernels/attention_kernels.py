"""Triton paged-attention kernels: varlen prefill / chunked prefill and split-context decode.

Cache layout (one layer): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, keys at 0 and values
at 1; a token's cache slot is ``block * block_size + offset``. Keys are read through the block table one
tile of ``BLOCK_N`` tokens at a time, whatever the block size, so any block size works with any tile.
Softmax is online, in float32, base 2 (the scale is folded with log2(e) into the query).

Nothing here names a vendor: launch parameters come from :mod:`.launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.decode_merge_kernels import _merge_head, split_share
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_begin

LOG2E = 1.4426950408889634

#: Arguments (of any kernel here) that change with the batch's make-up: the block-table width
#: (``stride_bt``) and pointers into slices taken at a row offset, whose 16-byte alignment follows the
#: offset. Triton would compile a variant for each divisibility class of each, a second or so apiece and
#: mid-serving; the kernels read them as scalars, so specializing on them gains nothing. ``sinks_ptr`` is
#: ``seq_lens`` when a model has no sinks (an unread stand-in). Neither their values nor their alignment:
#: Triton 3.6 specializes a pointer's alignment even where it does not specialize its value.
BATCH_VARYING_ARGS = [
    "block_tables_ptr", "seq_lens_ptr", "query_start_ptr", "slot_ptr", "stride_bt", "rot_index_ptr", "sinks_ptr",
]  # fmt: skip


@triton.jit
def _soft_cap(scores, cap):
    # cap * tanh(scores / cap), with tanh through exp so it runs on every backend and the interpreter
    x = scores / cap
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def _dot(a, b, IS_FP32: tl.constexpr):
    if IS_FP32:
        # full fp32 products: the matrix units' reduced fp32 mode misses the float32 tolerance
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _dot_operand(q, DOT_F16: tl.constexpr):
    """The query in the dtype the products run in: fp16 over an FP8 cache (``DOT_F16``), else as is.

    The GPU turns e4m3 into fp16 in one instruction per pair but into bf16 only through fp32, which
    made an FP8 cache slower to read than bf16. Every e4m3 value and every bf16 query value within
    fp16's range is exact in fp16, and the softmax weights gain two mantissa bits; queries are clamped
    to fp16's range first.
    """
    if DOT_F16:
        return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        return q


@triton.jit
def _load_kv_tile(
    cache_ptr, block_table_ptr, offs_n, seq_len, kv_head, offs_d,
    stride_slot, stride_head,
    KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Keys (or values) ``[BLOCK_N, D_PAD]`` of context positions ``offs_n`` of one sequence."""
    valid = offs_n < seq_len
    block = tl.load(block_table_ptr + offs_n // KV_BLOCK, mask=valid, other=0).to(tl.int64)
    slot = block * KV_BLOCK + (offs_n % KV_BLOCK)
    ptrs = cache_ptr + slot[:, None] * stride_slot + kv_head * stride_head + offs_d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _load_step_kv_tile(
    rows_ptr, first_row, offs_n, seq_len, kv_head, offs_d, stride_row, stride_head, HEAD_DIM: tl.constexpr,
):
    """Keys (or values) ``[BLOCK_N, D_PAD]`` of context positions ``offs_n`` of a sequence whose whole
    context is this step's rows ``first_row, first_row + 1, ...`` (not the cache)."""
    valid = offs_n < seq_len
    rows = (first_row + offs_n).to(tl.int64)
    ptrs = rows_ptr + rows[:, None] * stride_row + kv_head * stride_head + offs_d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit(do_not_specialize=BATCH_VARYING_ARGS, do_not_specialize_on_alignment=BATCH_VARYING_ARGS)
def paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, sinks_ptr,
    scale, soft_cap, window,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_bt, stride_slot, stride_kv_head, stride_v_slot, stride_v_head,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr, IS_FP32: tl.constexpr,
    DOT_F16: tl.constexpr, USE_PDL: tl.constexpr, USE_SINKS: tl.constexpr, STEP_KV: tl.constexpr,
):
    """One program: ``BLOCK_M`` query rows of one head of one sequence, over its whole cached context.

    The query rows are the last ``query_len`` positions of a ``seq_len`` context whose keys and values
    (the new ones included) are already in the cache. ``USE_SINKS``: the head's sink starts the running
    softmax (its max and a sum of one), with no value. A window without ``CAUSAL`` is symmetric: key j
    is visible to row i iff ``|i - j| < window`` (so the tile's last row reads ``window - 1`` keys on).
    ``STEP_KV``: the keys and values are this step's own rows (``k_cache_ptr`` / ``v_cache_ptr`` point at
    ``[tokens, kv_heads, head_dim]`` tensors, values with their own strides), for sequences with no cached
    prefix; the block table is not read.
    """
    pdl_begin(USE_PDL)
    # tiles, then heads, vary fastest: the programs that read one sequence's keys for one KV head run
    # side by side and share them through L2
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    kv_head = head // NUM_QUERIES_PER_KV

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n0 = tl.arange(0, BLOCK_N)
    row_ok = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    q_pos = prefix + offs_m  # context position of each query row
    q = _dot_operand(q, DOT_F16)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        m_i = m_i * 0.0 + tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(seq_len, prefix + tile * BLOCK_M + BLOCK_M)
    elif USE_WINDOW:
        hi = tl.minimum(seq_len, prefix + tile * BLOCK_M + BLOCK_M - 1 + window)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, prefix + tile * BLOCK_M - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    bt_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    qk_scale = scale * 1.4426950408889634
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        if STEP_KV:
            k = _load_step_kv_tile(k_cache_ptr, q_start, offs_n, seq_len, kv_head, offs_d,
                                   stride_slot, stride_kv_head, HEAD_DIM)
        else:
            k = _load_kv_tile(k_cache_ptr, bt_ptr, offs_n, seq_len, kv_head, offs_d,
                              stride_slot, stride_kv_head, KV_BLOCK, HEAD_DIM)
        qk = _dot(q, tl.trans(k.to(q.dtype)), IS_FP32)
        if USE_CAP:
            qk = _soft_cap(qk * scale, soft_cap) * 1.4426950408889634
        else:
            qk = qk * qk_scale
        visible = (offs_n[None, :] < seq_len) & row_ok[:, None]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
            if not CAUSAL:
                visible = visible & (offs_n[None, :] < q_pos[:, None] + window)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if STEP_KV:
            v = _load_step_kv_tile(v_cache_ptr, q_start, offs_n, seq_len, kv_head, offs_d,
                                   stride_v_slot, stride_v_head, HEAD_DIM)
        else:
            v = _load_kv_tile(v_cache_ptr, bt_ptr, offs_n, seq_len, kv_head, offs_d,
                              stride_v_slot, stride_v_head, KV_BLOCK, HEAD_DIM)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), IS_FP32)
        m_i = m_new

    out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
    )


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
def _head_norm(x, x_partner, weight_ptr, eps, offs_d, partner, d_ok, HEAD_DIM: tl.constexpr):
    """Rows ``x`` ``[rows, D_PAD]`` (masked dims zero) and their rotation partners, RMS-normalised by each
    row's own statistic and scaled per dim, rounded back to x's dtype as the norm kernel stores them."""
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / HEAD_DIM + eps)
    w = tl.load(weight_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    w_partner = tl.load(weight_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
    normed = (xf * inv[:, None] * w[None, :]).to(x.dtype)
    normed_partner = (x_partner.to(tl.float32) * inv[:, None] * w_partner[None, :]).to(x.dtype)
    return normed, normed_partner


@triton.jit
def _attend_tile(q, k, v, offs_n, kv_end, q_pos, window, scale, soft_cap, qk_scale, m_i, l_i, acc,
                 USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr, IS_FP32: tl.constexpr):  # fmt: skip
    """One decode tile of keys ``k`` and values ``v`` (positions ``offs_n``, those from ``kv_end`` on masked)
    folded into the running max ``m_i``, sum ``l_i`` and accumulator ``acc`` of a head group."""
    qk = _dot(q, tl.trans(k.to(q.dtype)), IS_FP32)
    if USE_CAP:
        qk = _soft_cap(qk * scale, soft_cap) * 1.4426950408889634
    else:
        qk = qk * qk_scale
    visible = offs_n[None, :] < kv_end
    if USE_WINDOW:
        visible = visible & (offs_n[None, :] > q_pos - window)
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), IS_FP32)
    return m_new, l_i, acc


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
    SKIP_IDLE: tl.constexpr = False,
):
    """One program: every query head of one KV head of one sequence (one new token each), over one
    contiguous share of the context (flash-decoding). Keys are read once for the whole head group.

    With one split the normalised result goes straight to ``out``; otherwise the unnormalised
    accumulator and its running max / sum go to the partial buffers for :func:`.decode_merge_kernels.decode_merge_kernel`; with
    ``MERGE_LAST`` each program counts itself in ``arrivals[seq, kv_head]`` (int32, zero before the launch)
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

    ``SKIP_IDLE`` (several splits, merged by :func:`.decode_merge_kernels.decode_merge_kernel`): a split past the end of its
    sequence's context writes no partials and ends at once.

    Under PDL with ``WRITE_KV`` (and ``EARLY_KV``) a program reads its context length, block table and
    first key and value tiles before it waits for the kernel that wrote the query: none of them is written
    by this step's kernels (the lengths and tables are copied in before the step, the cached positions by
    earlier steps, and this step's own key and value arrive in ``new_k`` / ``new_v``), so the cache reads
    overlap that kernel's tail instead of following it. Without ``WRITE_KV`` an earlier kernel of the step
    may have written the cache, so everything waits.
    """
    early: tl.constexpr = USE_PDL and WRITE_KV and EARLY_KV
    if USE_PDL:
        gdc_launch_dependents()
        if not early:
            gdc_wait()
    # KV heads vary fastest across programs: a token's heads sit side by side in the cache, so the
    # programs running together read whole cache rows rather than one head's slice of many rows (which
    # halved the DRAM efficiency of an FP8 cache, whose slices are half as long)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n0 = tl.arange(0, BLOCK_N)
    heads = kv_head * NUM_QUERIES_PER_KV + offs_g
    g_ok = offs_g < NUM_QUERIES_PER_KV
    d_ok = offs_d < HEAD_DIM
    row = seq.to(tl.int64)
    lo, span, per_split = split_share(seq_len, window, NUM_SPLITS, BLOCK_N, USE_WINDOW)
    start = lo + split * per_split
    if SKIP_IDLE:
        # a graph's split count is fixed for any context: the splits past a short one's end have nothing to
        # do, and the merge does not read them; they leave at once (before any wait: split 0 always waits,
        # so the launch still ends after its predecessor)
        if (split > 0) & (start >= seq_len):
            return
    end = tl.minimum(start + per_split, seq_len)
    q_pos = seq_len - 1
    # with WRITE_KV the last position comes from new_k / new_v, not from the cache
    cached_end = end
    if WRITE_KV:
        cached_end = tl.minimum(end, q_pos)
    bt_ptr = block_tables_ptr + row * stride_bt
    # the first tile, before the wait under PDL (see above); the loop below takes the rest
    k_first = _load_kv_tile(k_cache_ptr, bt_ptr, start + offs_n0, cached_end, kv_head, offs_d,
                            stride_slot, stride_kv_head, KV_BLOCK, HEAD_DIM)
    v_first = _load_kv_tile(v_cache_ptr, bt_ptr, start + offs_n0, cached_end, kv_head, offs_d,
                            stride_slot, stride_kv_head, KV_BLOCK, HEAD_DIM)
    if early:
        gdc_wait()
    q = tl.load(
        q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if ROTARY:
        cos, sin, partner, sign = _rotation(rot_index_ptr, rot_table_ptr, seq, stride_rot, offs_d, d_ok, HEAD_DIM)
        q_partner = tl.load(
            q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head + partner[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if HEAD_NORM:
            q, q_partner = _head_norm(q, q_partner, q_norm_ptr, norm_eps, offs_d, partner, d_ok, HEAD_DIM)
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
    # a tile past cached_end is all masked: it leaves the running max, sum and accumulator as they are
    m_i, l_i, acc = _attend_tile(q, k_first, v_first, start + offs_n0, cached_end, q_pos, window, scale, soft_cap,
                                 qk_scale, m_i, l_i, acc, USE_WINDOW, USE_CAP, IS_FP32)
    for start_n in range(start + BLOCK_N, cached_end, BLOCK_N):
        offs_n = start_n + offs_n0
        k = _load_kv_tile(k_cache_ptr, bt_ptr, offs_n, cached_end, kv_head, offs_d,
                          stride_slot, stride_kv_head, KV_BLOCK, HEAD_DIM)
        v = _load_kv_tile(v_cache_ptr, bt_ptr, offs_n, cached_end, kv_head, offs_d,
                          stride_slot, stride_kv_head, KV_BLOCK, HEAD_DIM)
        m_i, l_i, acc = _attend_tile(q, k, v, offs_n, cached_end, q_pos, window, scale, soft_cap, qk_scale,
                                     m_i, l_i, acc, USE_WINDOW, USE_CAP, IS_FP32)
    if WRITE_KV:
        # scalar conditions broadcast by hand: a scalar boolean in a mask trips Triton's interpreter
        pos_d = offs_d * 0 + q_pos
        own_d = (pos_d >= start) & (pos_d < end) & d_ok
        slot = tl.load(slot_ptr + seq + offs_d * 0).to(tl.int64)
        k_new = tl.load(new_k_ptr + row * stride_nk_tok + kv_head * stride_nk_head + offs_d, mask=own_d, other=0.0)
        if ROTARY:
            k_partner = tl.load(new_k_ptr + row * stride_nk_tok + kv_head * stride_nk_head + partner, mask=own_d, other=0.0)
            if HEAD_NORM:
                k_new, k_partner = _head_norm(
                    k_new[None, :], k_partner[None, :], k_norm_ptr, norm_eps, offs_d, partner, d_ok, HEAD_DIM
                )
                k_new, k_partner = tl.reshape(k_new, (D_PAD,)), tl.reshape(k_partner, (D_PAD,))
            k_rot = k_new.to(tl.float32) * cos + sign * k_partner.to(tl.float32) * sin
            k_new = k_rot.to(new_k_ptr.dtype.element_ty)
        v_new = tl.load(new_v_ptr + row * stride_nv_tok + kv_head * stride_nv_head + offs_d, mask=own_d, other=0.0)
        # what the cache holds, then what the loop would have read from it
        k_new = k_new.to(k_cache_ptr.dtype.element_ty)
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)
        dst = k_cache_ptr + slot * stride_slot + kv_head * stride_kv_head + offs_d
        tl.store(dst, k_new, mask=own_d & (slot >= 0))
        tl.store(v_cache_ptr + slot * stride_slot + kv_head * stride_kv_head + offs_d, v_new, mask=own_d & (slot >= 0))
        kq = k_new.to(q.dtype).to(tl.float32)
        qk1 = tl.sum(q.to(tl.float32) * kq[None, :], 1)
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
        acc = acc * alpha[:, None] + p1[:, None] * v_new.to(q.dtype).to(tl.float32)[None, :]
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(
            out_ptr + row * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )
    else:
        # partials: acc [seqs, heads, splits, D_PAD], (m, l) [seqs, heads, splits, 2]
        num_heads = tl.num_programs(0) * NUM_QUERIES_PER_KV
        part = (row * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], acc, mask=g_ok[:, None])
        # an empty split reports m = -inf so that the merge gives it no weight
        m_out = tl.where(l_i > 0.0, m_i, float("-inf"))
        tl.store(part_ml_ptr + part * 2, m_out, mask=g_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)
        if MERGE_LAST:
            # every thread's partials are stored before the count (acquire-release at GPU scope) says so
            tl.debug_barrier()
            count = arrivals_ptr + row * tl.num_programs(0) + kv_head
            # a graph's split count is fixed for any context: only the first splits of a short one hold keys
            used = (span + per_split - 1) // tl.maximum(per_split, 1)
            if tl.atomic_add(count, 1) == NUM_SPLITS - 1:
                for g in tl.static_range(NUM_QUERIES_PER_KV):
                    # .cg: the other programs' partials from L2, never a stale L1 line
                    _merge_head(out_ptr, part_acc_ptr, part_ml_ptr, row, kv_head * NUM_QUERIES_PER_KV + g,
                                num_heads, stride_o_tok, stride_o_head, used, NUM_SPLITS, HEAD_DIM, D_PAD, True)
                tl.atomic_xchg(count, 0)


@triton.jit(do_not_specialize=BATCH_VARYING_ARGS, do_not_specialize_on_alignment=BATCH_VARYING_ARGS)
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per new token: copy its keys and values to its cache slot; a negative slot is skipped."""
    pdl_begin(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    # the slot test is broadcast by hand: a scalar boolean in a mask trips Triton's interpreter
    keep = (offs_h[:, None] * 0 + slot) >= 0
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & keep
    k = tl.load(key_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    dst = slot * stride_slot + offs_h[:, None] * stride_cache_head + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

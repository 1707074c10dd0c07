"""Triton paged-attention kernels: varlen prefill / chunked prefill, the KV write, and the pieces the decode kernel
(:mod:`.decode_attention_kernels`) shares.

Cache layout (one layer): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, keys at 0 and values
at 1; a token's cache slot is ``block * block_size + offset``. Keys are read through the block table one
tile of ``BLOCK_N`` tokens at a time, whatever the block size, so any block size works with any tile.
Softmax is online, in float32, base 2 (the scale is folded with log2(e) into the query).

Nothing here names a vendor: launch parameters come from :mod:`.launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.pdl import pdl_begin

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

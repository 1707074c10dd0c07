"""Host-side launchers of the shared Triton kernels: shape checks, grids and launch parameters.

They take plain torch tensors and a :class:`~.launch.KernelTuning`, never a device query, so the same
functions serve any backend Triton compiles for (and Triton's CPU interpreter in tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine_plugin_sdk.dtypes import FP8_DTYPES
from engine_plugin_sdk.gpu.triton_kernels import attention_kernels as ak
from engine_plugin_sdk.gpu.triton_kernels import decode_attention_kernels as dak
from engine_plugin_sdk.gpu.triton_kernels import decode_merge_kernels as dmk
from engine_plugin_sdk.gpu.triton_kernels import elementwise_kernels as ek
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.l2_prefetch import l2_share_args
from engine_plugin_sdk.gpu.triton_kernels.launch import KernelTuning, next_power_of_2

if TYPE_CHECKING:
    from engine.interfaces.attention import HeadNorm

#: the decode grid's sequence axis is its second, which CUDA caps at 65,535 programs
MAX_DECODE_SEQS = 65_535


def row_warps(block: int) -> int:
    """The warps of a row kernel over ``block`` columns (a power of two) in one program."""
    # about 256 elements per warp keeps a row's registers in check up to hidden sizes of 16k
    return max(1, min(16, block // 256))


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a unit last stride (a view when possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store keys and values ``[tokens, kv_heads, head_dim]`` into the cache at ``slot_mapping``.

    Raises:
        ValueError: for tensors that do not fit the cache or a slot mapping of the wrong length.
    """
    tokens, kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} shapes differ")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (kv_heads, head_dim):
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} is not [2, blocks, block_size, {kv_heads}, {head_dim}]"
        )
    if slot_mapping.numel() != tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries for {tokens} tokens")
    if tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    ak.write_kv_kernel[(tokens,)](
        key, value, kv_cache[0], kv_cache[1], slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        H_PAD=next_power_of_2(kv_heads), D_PAD=next_power_of_2(head_dim), **pdl.launch_options(),
    )  # fmt: skip


def _attention_flags(query: torch.Tensor, kv_cache: torch.Tensor, window: int | None, soft_cap: float | None) -> dict:
    return {
        "USE_WINDOW": window is not None,
        "USE_CAP": soft_cap is not None,
        "IS_FP32": query.dtype == torch.float32,
        # products over an FP8 cache run in fp16 (see attention_kernels._dot_operand)
        "DOT_F16": kv_cache.dtype in FP8_DTYPES and query.dtype != torch.float32,
    }


def paged_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    tuning: KernelTuning,
    causal: bool = True,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    step_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Attention for any mix of prefill, chunked-prefill and decode rows; keys come from the cache only
    (or, with ``step_kv``, from the step's own rows).

    Args:
        out: ``[tokens, heads, head_dim]``, written.
        query: ``[tokens, heads, head_dim]`` (unit last stride).
        kv_cache: ``[2, blocks, block_size, kv_heads, head_dim]`` holding every context token already.
        block_tables: int32 ``[seqs, max_blocks]``.
        seq_lens: int32 ``[seqs]`` context lengths, new tokens included.
        query_start_loc: int32 ``[seqs + 1]``.
        max_query_len: longest query of the batch (sizes the grid).
        scale: softmax scale.
        tuning: launch parameters of the target.
        causal: causal masking (offset by each sequence's cached prefix).
        window: sliding window, or None; symmetric (``|i - j| < window``) when not ``causal``.
        soft_cap: logit soft-cap, or None.
        sinks: float ``[heads]`` attention sinks (one more softmax term per head, no value), or None.
        step_kv: ``(key, value)`` ``[tokens, kv_heads, head_dim]`` (unit last stride) of the step's rows,
            read instead of the cache, for a batch whose every query is its whole context (no cached
            prefix, as in a non-causal step); ``kv_cache`` then only gives the KV geometry.
    """
    tokens, num_heads, head_dim = query.shape
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    tiles = tuning.prefill_tiles(head_dim)
    grid = (triton_cdiv(max_query_len, tiles.block_m), num_heads, num_seqs)
    keys, values = step_kv if step_kv is not None else (kv_cache[0], kv_cache[1])
    # a cache's slots are its second-to-last dims but one; a step's rows are its first
    row_dim = 0 if step_kv is not None else 1
    ak.paged_prefill_kernel[grid](
        out, query, keys, values, block_tables, seq_lens, query_start_loc,
        sinks if sinks is not None else seq_lens, scale, float(soft_cap or 0.0), int(window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        keys.stride(row_dim), keys.stride(row_dim + 1), values.stride(row_dim), values.stride(row_dim + 1),
        NUM_QUERIES_PER_KV=num_heads // kv_heads,
        HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim), KV_BLOCK=block_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, CAUSAL=causal, USE_SINKS=sinks is not None,
        STEP_KV=step_kv is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **_attention_flags(query, keys, window, soft_cap), **pdl.launch_options(),
    )  # fmt: skip


#: the decode kernel reads its first tile before its PDL wait (``KernelTuning.decode_early_kv``) only where its
#: programs are at most this many per multiprocessor: the read ahead pays where one wave of programs waits on the
#: kernel before (batch-1 decode: 256 programs of Llama-3-8B's heads on 132 SMs), while the tile held in registers
#: through the wait costs programs registers (Triton 3.6 for sm_90, bf16 cache, 64-key tiles: 214 against 144), so
#: that two of them fit an SM instead of three; past two an SM the grid would take more waves for it
EARLY_KV_WAVES = 2


def paged_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    tuning: KernelTuning,
    window: int | None = None,
    soft_cap: float | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    head_norm: HeadNorm | None = None,
    arrivals: torch.Tensor | None = None,
    l2_ahead: torch.Tensor | None = None,
) -> None:
    """Attention of one new token per sequence (row ``i`` belongs to sequence ``i``), context split
    across ``num_splits`` programs per KV head and merged by a second kernel.

    Args:
        out: ``[seqs, heads, head_dim]``, written.
        query: ``[seqs, heads, head_dim]``.
        kv_cache, block_tables, seq_lens, scale, window, soft_cap, sinks: as for :func:`paged_prefill`;
            a sequence of length 0 (graph padding) gets zeros.
        num_splits: a power of two (see :meth:`KernelTuning.decode_splits`); fixed for a captured graph.
        tuning: launch parameters of the target.
        new_kv: ``(key, value, slot_mapping)`` of the new tokens (``[seqs, kv_heads, head_dim]`` and
            ``[seqs]``) when they are not in the cache yet: the decode kernel stores them (negative slots
            are skipped) and attends to them itself, so no separate :func:`write_kv` launch is needed.
            Without it the cache must already hold every position.
        rotary: ``(index, table)``: the query and ``new_kv``'s key are unrotated, and the kernel rotates
            them (rotate-half over the whole head) by ``table[index[i]]`` for sequence ``i``, ``table``
            float32 ``[rows, head_dim]`` holding cos then sin; the key is cached rotated. Needs ``new_kv``.
        head_norm: a :class:`HeadNorm` (``q_weight``, ``k_weight``, ``eps``): the query and the new key are
            unnormalised too, and the kernel RMS-normalises each head's row before rotating. Needs ``rotary``.
        arrivals: int32 zeros kept across calls, at least ``seqs * kv_heads``: the split programs count
            themselves there and the last of each merges (each launch leaves them zero), so no merge kernel
            is launched. None, or too few: the merge kernel.
        l2_ahead: a contiguous tensor (the next GEMV's weight) whose bytes the kernel's programs ask the L2 cache
            for once past their wait (an experiment: ``benchmarks/nvidia_l2_window.py``); None asks nothing.

    Raises:
        ValueError: for more sequences than a launch grid's second axis holds, a ``new_kv`` that does
            not match the batch, or a ``rotary`` without ``new_kv`` or of another width than the head.
    """
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs > MAX_DECODE_SEQS:
        raise ValueError(f"paged_decode takes at most {MAX_DECODE_SEQS} sequences a launch, not {num_seqs}")
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // kv_heads
    d_pad = next_power_of_2(head_dim)
    if num_splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, d_pad), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused by the kernel
    if new_kv is not None:
        new_k, new_v, slots = _checked_new_kv(new_kv, num_seqs, kv_heads, head_dim)
    else:
        new_k = new_v = slots = query  # unused by the kernel
    if rotary is not None:
        rot_index, rot_table = rotary
        if new_kv is None:
            raise ValueError("paged_decode rotates the new keys it stores: rotary needs new_kv")
        if rot_table.shape[-1] != head_dim or rot_table.stride(-1) != 1 or rot_index.numel() < num_seqs:
            raise ValueError(
                f"rotary table {tuple(rot_table.shape)} / index {tuple(rot_index.shape)} do not fit "
                f"{num_seqs} sequences of head size {head_dim}"
            )
    else:
        rot_index, rot_table = seq_lens, query  # unused by the kernel
    if head_norm is not None:
        if rotary is None:
            raise ValueError("paged_decode normalises heads on the way to rotating them: head_norm needs rotary")
        q_norm, k_norm, norm_eps = head_norm.q_weight, head_norm.k_weight, float(head_norm.eps)
        if q_norm.numel() != head_dim or k_norm.numel() != head_dim:
            raise ValueError(f"head norm weights {q_norm.numel()} / {k_norm.numel()} do not fit head size {head_dim}")
    else:
        q_norm = k_norm = query  # unused by the kernel
        norm_eps = 0.0
    merge_last = num_splits > 1 and arrivals is not None and arrivals.numel() >= num_seqs * kv_heads
    fp8_cache = kv_cache.dtype in FP8_DTYPES
    pair = tuning.decode_kv_heads(fp8_cache, num_seqs, kv_heads, group, head_dim)
    tiles = tuning.decode_tiles(fp8_cache, head_dim, pair)
    flags = _attention_flags(query, kv_cache, window, soft_cap)
    programs = kv_heads // pair * num_seqs * num_splits
    block_n = tiles["BLOCK_N"]
    min_share = -(-tuning.decode_min_split_keys // block_n) * block_n if num_splits > 1 else 0
    # only under PDL (graphs, whose variants compile at capture): eager launches keep one variant for any batch
    early_kv = tuning.decode_early_kv and pdl.active() and programs <= EARLY_KV_WAVES * tuning.num_compute_units
    dak.paged_decode_kernel[(kv_heads // pair, num_seqs, num_splits)](
        out, part_acc, part_ml, arrivals if merge_last else seq_lens, query, kv_cache[0], kv_cache[1], block_tables, seq_lens,
        new_k, new_v, slots, sinks if sinks is not None else seq_lens, rot_index, rot_table, q_norm, k_norm,
        scale, float(soft_cap or 0.0), int(window or 0), norm_eps,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), rot_table.stride(0),
        NUM_QUERIES_PER_KV=group, GROUP_PAD=max(16, next_power_of_2(group * pair)), NUM_SPLITS=num_splits,
        HEAD_DIM=head_dim, D_PAD=d_pad, KV_BLOCK=block_size, WRITE_KV=new_kv is not None,
        USE_SINKS=sinks is not None, ROTARY=rotary is not None, HEAD_NORM=head_norm is not None,
        MERGE_LAST=merge_last, EARLY_KV=early_kv,
        SKIP_IDLE=num_splits > 1, MIN_SHARE=min_share,
        # the scale folded into the query once: over an FP8 cache (whose values carry 2**-4 of error, against the
        # 2**-11 the fp16 query's rounding adds) and in float32; a bf16 / fp16 query over its own dtype keeps its bits
        KV_HEADS=pair, PRESCALED=soft_cap is None and (flags["DOT_F16"] or flags["IS_FP32"]),
        **tiles, **flags, **l2_share_args(l2_ahead, programs, query.is_cuda), **pdl.launch_options(),
    )  # fmt: skip
    if num_splits > 1 and not merge_last:
        ek_warps = 1 if d_pad * num_splits <= 2048 else 4
        dmk.decode_merge_kernel[(num_seqs, num_heads)](
            out, part_acc, part_ml, seq_lens, int(window or 0), out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_N=block_n,
            USE_WINDOW=flags["USE_WINDOW"], MIN_SHARE=min_share, num_warps=ek_warps, **pdl.launch_options(),
        )  # fmt: skip


def _checked_new_kv(
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_seqs: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode kernel's new key / value (unit last stride) and slots, checked against the batch."""
    key, value, slots = new_kv
    if key.shape != (num_seqs, kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"new key {tuple(key.shape)} / value {tuple(value.shape)} are not [{num_seqs}, {kv_heads}, {head_dim}]")
    if slots.numel() != num_seqs:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {num_seqs} sequences")
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    return key, value, slots


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, in float32, returned in x's dtype."""
    rows = rows_of(x)
    hidden = rows.shape[1]
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = next_power_of_2(hidden)
        ek.rms_norm_kernel[(rows.shape[0],)](
            out, rows, weight, eps, rows.stride(0), out.stride(0),
            HIDDEN=hidden, BLOCK=block, num_warps=row_warps(block), **pdl.launch_options(),
        )  # fmt: skip
    return out.view(x.shape)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last axis (``bias`` None for none), in float32, returned in x's dtype."""
    return _layer_norm(x, None, weight, bias, eps)


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm of ``x + residual`` in one pass (the sum rounded to x's dtype, as the unfused sum)."""
    return _layer_norm(x, residual, weight, bias, eps)


def _layer_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    rows = rows_of(x)
    res = rows_of(residual) if residual is not None else rows
    hidden = rows.shape[1]
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = next_power_of_2(hidden)
        # without a bias the weight stands in for the pointer; HAS_BIAS keeps the kernel from reading it
        ek.layer_norm_kernel[(rows.shape[0],)](
            out, rows, res, weight, weight if bias is None else bias, eps, rows.stride(0), res.stride(0),
            out.stride(0), HIDDEN=hidden, BLOCK=block, HAS_BIAS=bias is not None, num_warps=row_warps(block),
            HAS_RESIDUAL=residual is not None, **pdl.launch_options(),
        )  # fmt: skip
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass."""
    rows, res = rows_of(x), rows_of(residual)
    hidden = rows.shape[1]
    out = torch.empty_like(rows)
    res_out = torch.empty_like(res)
    if rows.shape[0]:
        block = next_power_of_2(hidden)
        ek.fused_add_rms_norm_kernel[(rows.shape[0],)](
            out, res_out, rows, res, weight, eps,
            rows.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            HIDDEN=hidden, BLOCK=block, num_warps=row_warps(block), **pdl.launch_options(),
        )  # fmt: skip
    return out.view(x.shape), res_out.view(residual.shape)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding, in place on ``query`` ``[tokens, heads, d]`` and ``key``; returns both.

    Raises:
        ValueError: if the cache's width is not the head size.
    """
    tokens, num_heads, head_dim = query.shape
    if cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"cos_sin_cache width {cos_sin_cache.shape[-1]} differs from head_dim {head_dim}")
    if tokens:
        half = head_dim // 2
        num_kv = key.shape[1]
        ek.rotary_kernel[(tokens,)](
            query, key, positions, cos_sin_cache,
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
            cos_sin_cache.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv, HALF=half,
            H_PAD=next_power_of_2(num_heads), KV_PAD=next_power_of_2(num_kv), HALF_PAD=next_power_of_2(half),
            num_warps=4, **pdl.launch_options(),
        )  # fmt: skip
    return query, key


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]``."""
    return _gated_activation(x, ek.SILU)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` (GeGLU, Gemma's MLP)."""
    return _gated_activation(x, ek.GELU_TANH)


def _gated_activation(x: torch.Tensor, act: int) -> torch.Tensor:
    rows = rows_of(x)
    d = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = min(1024, next_power_of_2(d))
        ek.gated_activation_kernel[(rows.shape[0], triton_cdiv(d, block))](
            out, rows, rows.stride(0), out.stride(0), D=d, BLOCK=block, ACT=act, num_warps=4, **pdl.launch_options(),
        )  # fmt: skip
    return out.view(*x.shape[:-1], d)


#: largest finite value of each FP8 flavour the row quantizer writes
_FP8_ROW_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}


def fp8_row_max(fp8: torch.dtype) -> float:
    """The largest finite value of an e4m3 flavour the row quantizers write.

    Raises:
        ValueError: for an FP8 dtype other than the two e4m3 flavours.
    """
    if fp8 not in _FP8_ROW_MAX:
        raise ValueError(f"the FP8 row quantizers write float8_e4m3fn or float8_e4m3fnuz, not {fp8}")
    return _FP8_ROW_MAX[fp8]


def empty_fp8_rows(m: int, k: int, fp8: torch.dtype, device: torch.device) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The largest value of ``fp8`` and uninitialised ``[m, k]`` FP8 rows with their float32 ``[m, 1]`` scales.

    Raises:
        ValueError: for an FP8 dtype other than the two e4m3 flavours.
    """
    limit = fp8_row_max(fp8)
    return limit, torch.empty((m, k), dtype=fp8, device=device), torch.empty((m, 1), dtype=torch.float32, device=device)


def quantize_rows_fp8(x: torch.Tensor, fp8: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` ``[M, K]`` as FP8 ``[M, K]`` with float32 scales ``[M, 1]`` (``max |row| / fp8 max``).

    Raises:
        ValueError: for an FP8 dtype other than the two e4m3 flavours.
    """
    rows = rows_of(x)
    m, k = rows.shape
    limit, out, scale = empty_fp8_rows(m, k, fp8, x.device)
    if m:
        block = next_power_of_2(k)
        # 8 warps, not 16: more rows in flight per multiprocessor (H200: 49 against 69 us at 16384 x 4096)
        ek.quantize_rows_fp8_kernel[(m,)](
            out, scale, rows, rows.stride(0), out.stride(0),
            K=k, BLOCK=block, FP8_MAX=limit, num_warps=min(8, row_warps(block)), **pdl.launch_options(),
        )  # fmt: skip
    return out, scale


#: columns per program of the greedy pick
GREEDY_BLOCK = 4096
#: the greedy pick splits each row's columns across programs (False: one program a row, the earlier path).
#: At every batch size, not only small ones: a row-count threshold would make a batch that first crosses it
#: compile the other kernel mid-serving; large batches read the same bytes either way
GREEDY_SPLIT = True


def greedy_pick(logits: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first maximum over the first ``vocab_size`` columns and its log-softmax value, one pass
    over the logits (torch's path writes a log-softmax copy and reads it twice more).

    Returns:
        int64 ids ``[rows]`` and float32 log-probabilities ``[rows]``.

    Raises:
        ValueError: for logits narrower than ``vocab_size``.
    """
    if logits.dim() != 2 or logits.shape[1] < vocab_size:
        raise ValueError(f"logits {tuple(logits.shape)} are not [rows, >= {vocab_size}]")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows = logits.shape[0]
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if not rows:
        return ids, logprobs
    block = min(GREEDY_BLOCK, next_power_of_2(vocab_size))
    warps = min(8, max(1, block // 256))
    chunks = triton_cdiv(vocab_size, block)
    if not GREEDY_SPLIT or chunks == 1:
        ek.greedy_pick_kernel[(rows,)](
            ids, logprobs, logits, logits.stride(0), vocab_size, BLOCK=block, num_warps=warps, **pdl.launch_options(),
        )  # fmt: skip
        return ids, logprobs
    # one program per BLOCK columns of each row, then a merge: at batch 1 the one-pass kernel ran a 256k
    # vocabulary's 63 tiles one after another on one multiprocessor
    best = torch.empty((rows, chunks), dtype=torch.int64, device=logits.device)
    m, total = torch.empty((2, rows, chunks), dtype=torch.float32, device=logits.device)
    ek.greedy_pick_partial_kernel[(rows, chunks)](
        best, m, total, logits, logits.stride(0), vocab_size,
        CHUNK=block, BLOCK=block, num_warps=warps, **pdl.launch_options(),
    )  # fmt: skip
    ek.greedy_pick_merge_kernel[(rows,)](
        ids, logprobs, best, m, total, chunks, vocab_size,
        CHUNKS_PAD=next_power_of_2(chunks), num_warps=1 if chunks <= 256 else 4, **pdl.launch_options(),
    )  # fmt: skip
    return ids, logprobs


def triton_cdiv(a: int, b: int) -> int:
    """Ceiling division for grid sizes."""
    return -(-a // b)

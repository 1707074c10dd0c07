"""Turns one step's :class:`AttentionMetadata` into index tensors and masks, once for all layers.

Everything here depends only on the batch description (lengths, block tables, window), never on the
layer, so the attention backend builds a :class:`StepPlan` on the first layer of a step and reuses it
for the others; the per-layer work is then just gathers, kernels and copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_plugin_cpu.chunked_softmax import additive_mask
from engine_plugin_sdk import AttentionMetadata


@dataclass(frozen=True, slots=True)
class ChunkBudget:
    """Limits on one key chunk, so memory stays bounded for long contexts and big batches.

    Attributes:
        max_blocks: most block-table columns per chunk.
        max_gather_elements: most key+value elements gathered from the cache per chunk.
        max_score_elements: most attention scores (``B * heads * rows * keys``) per chunk.
    """

    max_blocks: int = 256
    max_gather_elements: int = 8 * 1024 * 1024
    max_score_elements: int = 16 * 1024 * 1024

    def chunk_tokens(self, block_size: int, batch: int, kv_heads: int, head_dim: int, rows: int) -> int:
        """Keys per chunk: a whole number of blocks, at least one."""
        per_token_gather = 2 * batch * kv_heads * head_dim
        per_token_scores = batch * kv_heads * rows
        tokens = min(
            self.max_blocks * block_size,
            self.max_gather_elements // max(1, per_token_gather),
            self.max_score_elements // max(1, per_token_scores),
        )
        return max(1, tokens // block_size) * block_size


@dataclass(slots=True)
class KeyChunk:
    """Keys ``[start, start + num_tokens)`` of every sequence of a group.

    Attributes:
        start: position of the chunk's first key.
        num_tokens: keys gathered (a multiple of the block size when read from the cache).
        used_tokens: the leading keys attended; the rest are padding of the group's longest context,
            dropped rather than masked (a batch-of-one decode then needs no mask at all).
        block_ids: flat int64 ``[B * blocks]`` physical block ids, or None when the keys are the step's
            new tokens (a prefill without a cached prefix).
        mask: boolean ``[B, 1, R or 1, T]`` visibility, or None when every key is visible to every row.
        has_visible: ``[B, 1, R or 1]``, rows that see at least one key here; None if all do.
        additive: the mask as ``0 / -inf`` per dtype, built on first use.
    """

    start: int
    num_tokens: int
    used_tokens: int
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None
    has_visible: torch.Tensor | None
    additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.mask is None:
            return None
        cached = self.additive.get(dtype)
        if cached is None:
            cached = self.additive[dtype] = additive_mask(self.mask, dtype)
        return cached


@dataclass(slots=True)
class DecodeGroup:
    """All sequences with one new token, attended together in one batched pass.

    Attributes:
        rows: token rows of those sequences in the flat batch, or None when they are rows ``0..D-1``.
        num_seqs: D.
        chunks: the key chunks, each covering the same block-table columns for all D sequences.
    """

    rows: torch.Tensor | None
    num_seqs: int
    chunks: list[KeyChunk]


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with several new tokens (a prefill or a chunk of one).

    Attributes:
        start, end: its token rows in the flat batch.
        prefix_len: tokens already in the cache before this step.
        plain_causal: no prefix, window or cap: torch's causal SDPA on the new keys suffices.
        chunks: key chunks for the general path (empty when ``plain_causal``).
    """

    start: int
    end: int
    prefix_len: int
    plain_causal: bool
    chunks: list[KeyChunk]


@dataclass(slots=True)
class StepPlan:
    """The per-step work list shared by all layers.

    Attributes:
        sources: the metadata tensors the plan was built from (identity-checked on reuse).
        geometry: ``(block_size, num_heads, num_kv_heads, head_dim, causal, sliding_window,
            logits_soft_cap)`` it was built for.
        write_rows: rows of key/value to store, or None for all rows.
        write_slots: int64 cache slots of those rows.
        max_slot: the largest of them (-1 when none), to check against the cache size.
        decode: groups of sequences with one new token, bucketed by context length.
        prefills: the other sequences.
        work: multiply-adds of the score matmul, ``sum(query_len * context_len) * heads * head_dim``.
    """

    sources: tuple[object, ...]
    geometry: tuple[object, ...]
    write_rows: torch.Tensor | None
    write_slots: torch.Tensor
    max_slot: int
    decode: list[DecodeGroup]
    prefills: list[PrefillSeq]
    work: int


def build_step_plan(
    metadata: AttentionMetadata,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    budget: ChunkBudget,
) -> StepPlan:
    """Validate the batch description and precompute its index tensors and masks.

    Raises:
        ValueError: for inconsistent metadata, in one line naming the problem.
    """
    query_lens = [int(n) for n in metadata.query_lens_cpu]
    seq_lens = [int(n) for n in metadata.seq_lens_cpu]
    bs = int(metadata.block_size)
    check_metadata(metadata, query_lens, seq_lens, num_tokens)
    group = num_heads // num_kv_heads
    block_tables = torch.as_tensor(metadata.block_tables).to(torch.int64)
    window = metadata.sliding_window
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)

    slots = torch.as_tensor(metadata.slot_mapping).to(torch.int64).reshape(-1)
    if slots.numel() != num_tokens:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {num_tokens} tokens")
    keep = slots >= 0
    write_rows = None if bool(keep.all()) else keep.nonzero().view(-1)
    write_slots = slots if write_rows is None else slots.index_select(0, write_rows)

    decode_ids = [i for i, n in enumerate(query_lens) if n == 1]
    decode = [
        plan_decode(ids, starts, seq_lens, block_tables, bs, window, num_kv_heads, head_dim, budget)
        for ids in bucket_by_length(decode_ids, seq_lens)
    ]
    prefills = []
    for i, n in enumerate(query_lens):
        if n > 1:
            prefills.append(
                plan_prefill(
                    i,
                    starts[i],
                    n,
                    seq_lens[i],
                    block_tables,
                    bs,
                    metadata,
                    group,
                    num_kv_heads,
                    head_dim,
                    budget,
                )
            )
    return StepPlan(
        sources=(metadata.block_tables, metadata.seq_lens, metadata.slot_mapping),
        geometry=(bs, num_heads, num_kv_heads, head_dim, metadata.causal, window, metadata.logits_soft_cap),
        write_rows=write_rows,
        write_slots=write_slots,
        max_slot=int(write_slots.max()) if write_slots.numel() else -1,
        decode=decode,
        prefills=prefills,
        work=sum(q * n for q, n in zip(query_lens, seq_lens, strict=True)) * num_heads * head_dim,
    )


def check_metadata(
    metadata: AttentionMetadata, query_lens: list[int], seq_lens: list[int], num_tokens: int
) -> None:
    """Raise ValueError for a batch description this backend cannot have been meant to run."""
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"query_lens_cpu has {len(query_lens)} entries but seq_lens_cpu has {len(seq_lens)}")
    if sum(query_lens) != num_tokens:
        raise ValueError(f"query lengths sum to {sum(query_lens)} but the query has {num_tokens} rows")
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if q < 0 or q > s:
            raise ValueError(f"sequence {i}: query length {q} must be between 0 and its context length {s}")
    width = int(metadata.block_tables.shape[1]) if len(query_lens) else 0
    needed = max((-(-s // metadata.block_size) for s in seq_lens), default=0)
    if needed > width:
        raise ValueError(
            f"block_tables has {width} columns but a context of {max(seq_lens)} tokens needs {needed} blocks "
            f"of {metadata.block_size}"
        )
    if metadata.sliding_window is not None and metadata.sliding_window < 1:
        raise ValueError(f"sliding_window must be positive, got {metadata.sliding_window}")
    if metadata.logits_soft_cap is not None and metadata.logits_soft_cap <= 0:
        raise ValueError(f"logits_soft_cap must be positive, got {metadata.logits_soft_cap}")


def chunk_mask(
    start: int,
    num_keys: int,
    seq_lens: torch.Tensor,
    row_pos: torch.Tensor,
    causal: bool,
    window: int | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Visibility of keys ``[start, start + num_keys)`` for rows at positions ``row_pos``.

    Args:
        seq_lens: ``[B, 1, 1, 1]`` context lengths (keys at or beyond are block padding).
        row_pos: ``[B or 1, 1, R or 1, 1]`` position of each query row.

    Returns:
        ``(mask, has_visible)``, each None when it would be all True.
    """
    key_pos = torch.arange(start, start + num_keys, dtype=torch.int64).view(1, 1, 1, -1)
    visible = key_pos < seq_lens
    if causal:
        visible = visible & (key_pos <= row_pos)
    if window is not None:
        visible = visible & (key_pos > row_pos - window)
        if not causal:  # a non-causal window is symmetric (the contract's |i - j| < window)
            visible = visible & (key_pos < row_pos + window)
    if bool(visible.all()):
        return None, None
    has_visible = visible.any(dim=-1)
    return visible, None if bool(has_visible.all()) else has_visible


def cache_chunk(
    first_col: int,
    stop_col: int,
    block_size: int,
    context_end: int,
    block_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    row_pos: torch.Tensor,
    causal: bool,
    window: int | None,
) -> KeyChunk:
    """A chunk of block-table columns ``[first_col, stop_col)``, trimmed at the longest context."""
    start = first_col * block_size
    gathered = (stop_col - first_col) * block_size
    used = min(gathered, context_end - start)
    mask, has_visible = chunk_mask(start, used, seq_lens, row_pos, causal, window)
    return KeyChunk(start, gathered, used, block_ids, mask, has_visible)


def column_range(lowest_visible: int, context_len: int, block_size: int) -> tuple[int, int]:
    """Block-table columns holding keys ``[lowest_visible, context_len)``."""
    return max(0, lowest_visible) // block_size, -(-context_len // block_size)


def bucket_by_length(
    seq_ids: list[int], seq_lens: list[int], min_tokens: int = 4096, max_padding: float = 2.0
) -> list[list[int]]:
    """Split decode sequences so that short ones do not gather a long one's worth of padding blocks.

    A batched decode pass reads every sequence up to the group's longest context; a new bucket starts
    when that padded size would exceed ``max_padding`` times the real tokens (and ``min_tokens``, so
    small batches stay one pass). With one bucket the original order is kept (rows stay 0..D-1).
    """
    if not seq_ids:
        return []
    buckets: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i in sorted(seq_ids, key=lambda j: seq_lens[j]):
        n = seq_lens[i]
        padded = n * (len(current) + 1)
        if current and padded > min_tokens and padded > max_padding * (total + n):
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    buckets.append(current)
    return buckets if len(buckets) > 1 else [list(seq_ids)]


def plan_decode(
    seq_ids: list[int],
    starts: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    window: int | None,
    num_kv_heads: int,
    head_dim: int,
    budget: ChunkBudget,
) -> DecodeGroup:
    count = len(seq_ids)
    rows_list = [starts[i] for i in seq_ids]
    rows = None if rows_list == list(range(count)) else torch.tensor(rows_list, dtype=torch.int64)
    ids = torch.tensor(seq_ids, dtype=torch.int64)
    tables = (
        block_tables if count == block_tables.shape[0] and rows is None else block_tables.index_select(0, ids)
    )
    lens = [seq_lens[i] for i in seq_ids]
    lens_t = torch.tensor(lens, dtype=torch.int64).view(-1, 1, 1, 1)
    lowest = min(n - window for n in lens) if window is not None else 0
    first_col, end_col = column_range(lowest, max(lens), block_size)
    # causal and non-causal agree for the last token, which sees its whole context
    row_pos = lens_t - 1
    step = budget.chunk_tokens(block_size, count, num_kv_heads, head_dim, rows=1) // block_size
    chunks = []
    for col in range(first_col, end_col, step):
        stop = min(col + step, end_col)
        block_ids = tables[:, col:stop].reshape(-1).contiguous()
        chunks.append(cache_chunk(col, stop, block_size, max(lens), block_ids, lens_t, row_pos, True, window))
    return DecodeGroup(rows=rows, num_seqs=count, chunks=chunks)


def plan_prefill(
    seq: int,
    start: int,
    query_len: int,
    seq_len: int,
    block_tables: torch.Tensor,
    block_size: int,
    metadata: AttentionMetadata,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    budget: ChunkBudget,
) -> PrefillSeq:
    prefix = seq_len - query_len
    window = metadata.sliding_window
    plain = prefix == 0 and window is None and metadata.logits_soft_cap is None
    if plain:
        return PrefillSeq(start, start + query_len, prefix, True, [])
    # rows are folded as [kv_head, group * query_len]: group-major, position-minor
    positions = torch.arange(prefix, seq_len, dtype=torch.int64)
    row_pos = positions.repeat(group).view(1, 1, -1, 1)
    lens_t = torch.tensor([seq_len], dtype=torch.int64).view(1, 1, 1, 1)
    # the earliest row (position ``prefix``) reaches furthest back, causal or not
    lowest = prefix - window + 1 if window is not None else 0
    rows = group * query_len
    chunk = budget.chunk_tokens(block_size, 1, num_kv_heads, head_dim, rows=rows)
    chunks = []
    if prefix == 0:
        # keys are exactly the new tokens: read them from the step's key/value, not the cache
        for key_start in range(max(0, lowest), seq_len, chunk):
            n = min(chunk, seq_len - key_start)
            mask, has_visible = chunk_mask(key_start, n, lens_t, row_pos, metadata.causal, window)
            chunks.append(KeyChunk(key_start, n, n, None, mask, has_visible))
        return PrefillSeq(start, start + query_len, prefix, False, chunks)
    first_col, end_col = column_range(lowest, seq_len, block_size)
    step = chunk // block_size
    for col in range(first_col, end_col, step):
        stop = min(col + step, end_col)
        block_ids = block_tables[seq, col:stop].contiguous()
        chunks.append(
            cache_chunk(col, stop, block_size, seq_len, block_ids, lens_t, row_pos, metadata.causal, window)
        )
    return PrefillSeq(start, start + query_len, prefix, False, chunks)

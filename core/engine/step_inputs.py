"""The flat batch of one step: a scheduler step's rows as device tensors and attention metadata."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain, repeat

import numpy as np
import torch

from engine.block_manager import BlockManager
from engine.host_copy import tensor_to_device_async
from engine.hybrid_block_manager import HybridBlockManager
from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.lora import LoraStep
from engine.kv_groups import GroupedAttentionMetadata, KVGroupLayout, grouped_metadata
from engine.launched_step import LaunchedStep
from engine.lora.manager import LoraManager
from engine.lora.step_rows import lora_rows
from engine.pooling.pooler import PoolRows
from engine.prompt_logprobs import PromptRows, prompt_rows
from engine.scheduler import SchedulerOutput
from engine.sequence import PENDING_TOKEN, Sequence
from engine.speculative.verify import SpecRows


@dataclass(slots=True)
class StepInputs:
    """The flat batch of one step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    #: one metadata, or one per KV group for a model with groups
    metadata: AttentionMetadata | GroupedAttentionMetadata
    logits_indices: torch.Tensor
    #: the sequence each logits row is sampled for: a sequence whose chunk reached its end, and any
    #: siblings waiting to fork from it (they sample their first token from the same logits)
    sample_targets: list[Sequence]
    #: rows scoring prompt tokens (``prompt_logprobs``): their logits follow the sampled rows' in
    #: ``logits_indices``
    prompt_rows: list[PromptRows] = field(default_factory=list)
    #: rows of pooling requests, whose hidden states are pooled rather than turned into logits
    pool_rows: list[PoolRows] = field(default_factory=list)
    #: decodes with proposals: their logits follow the sampled rows' in ``logits_indices``
    spec_rows: list[SpecRows] = field(default_factory=list)
    #: each row's adapter slot, None when no row runs under an adapter
    lora: LoraStep | None = None
    #: each logits row's adapter slot (the rows ``logits_indices`` picks), None likewise
    lora_logits: LoraStep | None = None
    #: a pure decode's graph inputs, already in its bucket's shape (see ``decode_shape``): the input ids,
    #: positions and context lengths, then each KV group's slots and block table (a table may keep its
    #: own width); ``input_ids``, ``positions`` and ``metadata`` are views of their real rows
    graph_inputs: tuple[torch.Tensor, ...] | None = None
    #: ``logits_indices`` is every row in order (a decode step's usual case): the logits need no gather
    logits_all_rows: bool = False


def prepare_step_inputs(
    step: SchedulerOutput,
    previous: LaunchedStep | None,
    *,
    block_manager: BlockManager | HybridBlockManager,
    device: torch.device,
    scale: float,
    sliding_window: int | None,
    kv_layout: KVGroupLayout | None,
    lora_manager: LoraManager | None,
    decode_shape: Callable[[int, list[int]], tuple[int, int | None] | None] | None = None,
) -> StepInputs:
    """The flat batch of ``step`` on ``device``: rows fed by ``previous`` (the overlapped step in flight)
    take its sampled tokens on the device; ``kv_layout`` gives one table per KV group; ``lora_manager``
    names each row's adapter slot; ``decode_shape`` (the decode graphs'
    :meth:`~engine.decode_graphs.DecodeGraphs.padded_shape`) gives, for a pure decode of so many rows
    with tables of these widths, the rows and table width its graph reads (width None: the tables keep
    theirs), or None when no graph will replay it."""
    # Host work here is per sequence and per step, so at a few hundred sequences it competes with the
    # GPU's step time: one-token rows (decodes) take a short path, and tensors cross in two copies.
    bm = block_manager
    bs = bm.block_size
    # one table (and one slot per new token) per KV group; models without groups have one
    group_tables = [group.block_tables for group in bm.groups]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in group_tables]
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[list[int]]] = [[] for _ in group_tables]
    logits_indices: list[int] = []
    targets: list[Sequence] = []
    scored: list[PromptRows] = []
    pooled: list[PoolRows] = []
    speculated: list[SpecRows] = []
    # rows whose input is the previous (overlapped) step's sample, still only on the device
    fill_rows: list[int] = []
    fill_from: list[int] = []
    offset = 0
    for item in step.scheduled:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        seq_tables = [by_seq[seq.seq_id] for by_seq in group_tables]
        for rows, table in zip(tables, seq_tables):
            rows.append(table)
        query_lens.append(n)
        if n == 1:
            prompt_len = len(seq.prompt_token_ids)
            token = seq.prompt_token_ids[start] if start < prompt_len else seq.output_token_ids[start - prompt_len]
            if token == PENDING_TOKEN:
                if previous is None or seq.seq_id not in previous.row_of:
                    raise RuntimeError(f"sequence {seq.seq_id} waits for a token no step in flight samples")
                fill_rows.append(len(input_ids))
                fill_from.append(previous.row_of[seq.seq_id])
                token = 0
            input_ids.append(token)
            positions.append(start)
            block_idx, within = divmod(start, bs)
            for out, table in zip(slots, seq_tables):
                out.append(table[block_idx] * bs + within)
            seq_lens.append(start + 1)
        else:
            end = start + n
            if item.num_spec:
                # the last token, then the proposals this step verifies
                input_ids.extend(seq.token_slice(start, end - item.num_spec) + seq.spec_tokens[: item.num_spec])
            else:
                input_ids.extend(seq.token_slice(start, end))
            positions.extend(range(start, end))
            for out, table in zip(slots, seq_tables):
                # slots block by block rather than token by token: a long prefill is a few list extends
                pos = start
                while pos < end:
                    block_idx, within = divmod(pos, bs)
                    run = min(bs - within, end - pos)
                    base = table[block_idx] * bs + within
                    out.extend(range(base, base + run))
                    pos += run
            seq_lens.append(end)
        if seq.params.prompt_logprobs is not None:
            rows = prompt_rows(seq, start, start + n, offset)
            if rows is not None:
                scored.append(rows)
        if seq.pooling is not None:
            pooled.append(PoolRows(seq, offset, start, n))
            offset += n
            continue  # nothing is sampled for it
        if item.num_spec:
            speculated.append(SpecRows(seq, offset, seq.spec_tokens[: item.num_spec]))
            offset += n
            continue  # its rows are verified, not sampled
        offset += n
        if item.samples:
            logits_indices.append(offset - 1)
            targets.append(seq)
            for sibling in seq.pending_forks:
                logits_indices.append(offset - 1)
                targets.append(sibling)
    # the logits rows: sampled, then verified (each proposal's and the one after), then prompt-scoring
    for spec in speculated:
        logits_indices.extend(range(spec.first_row, spec.first_row + len(spec.drafts) + 1))
    for rows in scored:
        logits_indices.extend(range(rows.first_row, rows.first_row + rows.count))
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    widths = [max(len(t) for t in rows) for rows in tables]
    # a pure decode the decode graphs will replay is laid out in its bucket's shape already, so that the
    # graph reads it without a padding op per input (each a fixed cost at batch 1)
    pure_decode = decode_shape is not None and all(q == 1 for q in query_lens)
    shape = decode_shape(len(query_lens), widths) if pure_decode else None
    rows = len(query_lens)
    if shape is not None:
        rows, table_width = shape
        pad = rows - len(query_lens)
        input_ids += [0] * pad
        positions += [0] * pad
        seq_lens_padded = chain(seq_lens, [0] * pad)
        slots = [out + [-1] * pad for out in slots]
        if table_width is not None:
            widths = [table_width] * len(widths)
            tables = [rows_ + [[]] * pad for rows_ in tables]
    else:
        seq_lens_padded = iter(seq_lens)
    padded_tables = [
        chain.from_iterable(t + [0] * (width - len(t)) if len(t) < width else t for t in rows_)
        for rows_, width in zip(tables, widths)
    ]
    table_rows = len(tables[0])
    # Everything crosses in one transfer (each copy is a fixed cost that batch-1 decode pays every token):
    # the int64 fields, then the int32 ones as int32 (views on the device, no cast op), each of those
    # starting 16 bytes aligned
    parts64 = (input_ids, positions, logits_indices, fill_rows, fill_from, *slots)
    sizes64 = [len(p) for p in parts64]
    head = -(-sum(sizes64) // 2) * 2
    sizes32 = [len(qsl), rows, *(table_rows * width for width in widths)]
    gaps32 = [-size % 4 for size in sizes32]
    parts32 = chain.from_iterable(
        (part, repeat(0, gap)) for part, gap in zip((qsl, seq_lens_padded, *padded_tables), gaps32)
    )
    # numpy reads the ints straight from the iterator: a fifth of torch.tensor's time on a list (an
    # embedding step of 256 x 128 tokens packs about 100,000 of them)
    flat = np.concatenate((
        np.fromiter(chain(*parts64, repeat(0, head - sum(sizes64))), dtype=np.int64, count=head),
        np.fromiter(chain.from_iterable(parts32), dtype=np.int32, count=sum(sizes32) + sum(gaps32)).view(np.int64),
    ))  # fmt: skip
    packed = tensor_to_device_async(torch.from_numpy(flat), device)  # pinned: queued behind the step in flight
    # (split_with_sizes: Tensor.split's Python wrapper costs as much again, at batch 1 a tenth of this)
    ids_t, pos_t, logits_t, fill_rows_t, fill_from_t, *slots_t = packed[: sum(sizes64)].split_with_sizes(sizes64)
    qsl_t, seq_lens_t, *tables_t = packed[head:].view(torch.int32).split_with_sizes(
        list(chain.from_iterable(zip(sizes32, gaps32)))
    )[::2]
    if fill_rows:
        assert previous is not None and previous.token_ids is not None
        if fill_rows == fill_from == list(range(len(fill_rows))):
            # the usual decode: every row continues the same row of the step in flight
            ids_t[: len(fill_rows)].copy_(previous.token_ids[: len(fill_rows)])
        else:
            ids_t[fill_rows_t] = previous.token_ids[fill_from_t]
    table_tensors = [t.view(table_rows, width) for t, width in zip(tables_t, widths)]
    n, tokens = len(query_lens), qsl[-1]
    graph_inputs = None
    if shape is not None:
        graph_inputs = (ids_t, pos_t, seq_lens_t, *chain.from_iterable(zip(slots_t, table_tensors)))
        # the eager views: the real rows only
        ids_t, pos_t, seq_lens_t = ids_t[:tokens], pos_t[:tokens], seq_lens_t[:n]
        table_tensors, slots_t = [t[:n] for t in table_tensors], [t[:tokens] for t in slots_t]
    metadata: AttentionMetadata | GroupedAttentionMetadata = AttentionMetadata(
        query_start_loc=qsl_t,
        seq_lens=seq_lens_t,
        block_tables=table_tensors[0],
        slot_mapping=slots_t[0],
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=bs,
        scale=scale,
        sliding_window=sliding_window,
    )
    if kv_layout is not None:
        metadata = grouped_metadata(metadata, kv_layout, table_tensors, slots_t)
    lora, lora_logits = lora_rows(lora_manager, step, device, logits_indices) if lora_manager is not None else (None, None)
    return StepInputs(
        input_ids=ids_t,
        positions=pos_t,
        metadata=metadata,
        logits_indices=logits_t,
        sample_targets=targets,
        prompt_rows=scored,
        pool_rows=pooled,
        spec_rows=speculated,
        lora=lora,
        lora_logits=lora_logits,
        graph_inputs=graph_inputs,
        logits_all_rows=len(logits_indices) == tokens and logits_indices == list(range(tokens)),
    )

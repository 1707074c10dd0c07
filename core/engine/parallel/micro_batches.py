"""Pipeline micro-batches: a step's sequences cut into consecutive groups that flow down the stages one
after another, so that stage ``s`` runs group ``i + 1`` while stage ``s + 1`` runs group ``i``.

Every rank cuts the same step the same way (the cut depends only on the step's host-side lengths) and
runs the same order: first every group's forward (each stage receives a group's activations from the
one before and sends its own on), then every group's logits (the last stage sends them to stage 0). A
stage's sends are thus always answered by a receive its neighbour has already reached, whatever the
number of groups: no stage waits on one that waits on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from engine.interfaces.attention import AttentionMetadata


@dataclass(slots=True)
class MicroBatch:
    """One group of consecutive sequences of a flat step.

    Attributes:
        tokens: its rows of the flat batch.
        metadata: its sequences' attention metadata.
        logits_rows: the rows of the group's hidden states that sample (indices within the group), or
            None when none of its rows does.
    """

    tokens: slice
    metadata: AttentionMetadata
    logits_rows: torch.Tensor | None


def slice_metadata(meta: AttentionMetadata, first: int, last: int) -> AttentionMetadata:
    """The metadata of sequences ``first..last-1`` alone (their rows renumbered from 0)."""
    starts = meta.query_start_loc[first : last + 1]
    query_lens, seq_lens = meta.query_lens_cpu[first:last], meta.seq_lens_cpu[first:last]
    token_start = sum(meta.query_lens_cpu[:first])
    return dataclasses.replace(
        meta,
        query_start_loc=starts - starts[0],
        seq_lens=meta.seq_lens[first:last],
        block_tables=meta.block_tables[first:last],
        slot_mapping=meta.slot_mapping[token_start : token_start + sum(query_lens)],
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        extras={},
    )


def split_micro_batches(
    metadata: AttentionMetadata, logits_indices: torch.Tensor | None, count: int
) -> list[MicroBatch]:
    """Up to ``count`` groups of consecutive sequences, of about equal tokens each (never empty).

    Args:
        metadata: the whole step's metadata.
        logits_indices: the flat rows that sample, ascending (None: none does).
        count: the most groups.
    """
    query_lens = metadata.query_lens_cpu
    total = sum(query_lens)
    groups: list[tuple[int, int]] = []
    first, done = 0, 0
    for i, length in enumerate(query_lens):
        done += length
        # close a group once it holds its share of the tokens, leaving a sequence for each group after it
        share = total * (len(groups) + 1) / count
        if done >= share and len(groups) < count - 1 and len(query_lens) - (i + 1) >= 1:
            groups.append((first, i + 1))
            first = i + 1
    groups.append((first, len(query_lens)))
    batches = []
    token = 0
    rows = logits_indices.tolist() if logits_indices is not None else []
    for start, stop in groups:
        size = sum(query_lens[start:stop])
        own = [r - token for r in rows if token <= r < token + size]
        device = logits_indices.device if logits_indices is not None else None
        batches.append(MicroBatch(
            slice(token, token + size), slice_metadata(metadata, start, stop),
            torch.tensor(own, dtype=torch.int64, device=device) if own else None,
        ))  # fmt: skip
        token += size
    return batches


def forward_logits(
    model: Any,
    kv_caches: list[Any],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
    logits_indices: torch.Tensor | None,
    count: int,
) -> torch.Tensor | None:
    """A pipeline-parallel step in micro-batches: the logits of the sampled rows, in row order, on stage 0
    (None on the other stages, or when no row samples).

    Args:
        model: this rank's stage of the model (``forward`` and ``compute_logits``).
        kv_caches: its layers' caches.
        input_ids: the flat step's token ids.
        positions: their positions.
        metadata: the step's attention metadata (one table per sequence: no KV groups).
        logits_indices: the rows that sample (None: none).
        count: the most micro-batches.
    """
    # the groups hand back their rows in row order: sort the sampled rows, and put them back after
    order = torch.argsort(logits_indices, stable=True) if logits_indices is not None else None
    ordered = logits_indices[order] if logits_indices is not None and order is not None else None
    batches = split_micro_batches(metadata, ordered, count)
    hidden = [
        model.forward(input_ids[mb.tokens], positions[mb.tokens], kv_caches, mb.metadata) for mb in batches
    ]
    if ordered is None or order is None:
        return None
    parts = [
        model.compute_logits(h.index_select(0, mb.logits_rows))
        for h, mb in zip(hidden, batches)
        if mb.logits_rows is not None
    ]
    if not parts or parts[0] is None:
        return None
    logits = torch.cat(parts)
    restored = torch.empty_like(logits)
    restored[order] = logits
    return restored

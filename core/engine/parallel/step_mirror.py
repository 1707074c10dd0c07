"""What the driver sends the other tensor-parallel ranks each step: the same forward, on their shards."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from engine.interfaces.attention import AttentionMetadata
from engine.kv_groups import GroupedAttentionMetadata


@dataclass(slots=True)
class StepMessage:
    """One step's block moves and flat batch, with host tensors (every rank moves them to its device).

    Attributes:
        swap_out: ``(device block, host block)`` pairs to swap out first.
        copies: ``(src, dst)`` block copies (copy-on-write), after the swap-out.
        swap_in: ``(host block, device block)`` pairs, last.
        input_ids: the flat batch's token ids.
        positions: their positions.
        metadata: the attention metadata (one, or one per KV group), backend scratch dropped.
        logits_indices: the hidden rows the driver computes logits for (every rank joins the lm_head's
            gather), or None when the step samples nothing.
        graph_bucket: the decode-graph bucket the driver replays the step through, which every rank
            replays too (:mod:`engine.parallel.rank_graphs`); None: the step runs eagerly everywhere.
    """

    swap_out: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata | GroupedAttentionMetadata
    logits_indices: torch.Tensor | None
    graph_bucket: int | None = None


def moved(value: Any, device: torch.device | str) -> Any:
    """``value`` with its tensors on ``device``; an attention metadata loses its backend scratch (``extras``)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, GroupedAttentionMetadata):
        return dataclasses.replace(value, by_group=[moved(m, device) for m in value.by_group])
    if isinstance(value, AttentionMetadata):
        fields = {
            f.name: moved(getattr(value, f.name), device)
            for f in dataclasses.fields(value)
            if isinstance(getattr(value, f.name), torch.Tensor)
        }
        return dataclasses.replace(value, extras={}, **fields)
    return value


def step_message(
    swap_out: list[tuple[int, int]],
    copies: list[tuple[int, int]],
    swap_in: list[tuple[int, int]],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata | GroupedAttentionMetadata,
    logits_indices: torch.Tensor | None,
    graph_bucket: int | None = None,
) -> StepMessage:
    """A :class:`StepMessage` with every tensor on the host (pickled to the other ranks' processes)."""
    return StepMessage(
        list(swap_out), list(copies), list(swap_in), moved(input_ids, "cpu"), moved(positions, "cpu"),
        moved(metadata, "cpu"), moved(logits_indices, "cpu") if logits_indices is not None else None,
        graph_bucket,
    )  # fmt: skip

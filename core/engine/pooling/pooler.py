"""Pooling a step's hidden states: which rows belong to which pooling request, their per-chunk
reduction on the device, and the finished vector (dimensions cut, then normalized) once a prompt is done.

A prompt may arrive in several chunks (chunked prefill): each chunk contributes a partial sum (MEAN), its
first row (CLS, the chunk at position 0) or its last row (LAST, the chunk that ends the prompt), or, for
the per-token types (ALL, STEP), all its rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.pooling.config import PoolerConfig
from engine.pooling.params import PoolingParams
from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PoolRows:
    """The rows of one step holding part of one pooling request's prompt.

    Attributes:
        seq: the request's sequence.
        first_row: its first row in the step's flat batch.
        first_position: the prompt position of that row.
        count: how many rows.
    """

    seq: Sequence
    first_row: int
    first_position: int
    count: int


@dataclass(slots=True)
class PooledChunk:
    """One chunk's contribution, on the host: the sum of its rows, its first and last rows, and every row
    for a per-token pooling type."""

    seq: Sequence
    first_position: int
    count: int
    total: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    rows: torch.Tensor | None = None


def pool_chunks(hidden: torch.Tensor, rows: list[PoolRows]) -> list[PooledChunk]:
    """Each chunk's reduction of ``hidden [tokens, width]``, in float32 on the host."""
    out = []
    for r in rows:
        block = hidden[r.first_row : r.first_row + r.count].float()
        every = block.cpu() if r.seq.pooling.per_token else None
        out.append(PooledChunk(r.seq, r.first_position, r.count, block.sum(dim=0).cpu(), block[0].cpu(), block[-1].cpu(), every))
    return out


@dataclass(slots=True)
class PoolingState:
    """What one pooling request has accumulated so far."""

    params: PoolingParams
    total: torch.Tensor | None = None
    first: torch.Tensor | None = None
    last: torch.Tensor | None = None
    tokens: int = 0
    seen: set[int] = field(default_factory=set)
    #: per-token types: each chunk's rows by its first position
    rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, chunk: PooledChunk) -> None:
        """Take a chunk (one computed again after a preemption is taken once)."""
        if chunk.first_position in self.seen:
            return
        self.seen.add(chunk.first_position)
        self.total = chunk.total if self.total is None else self.total + chunk.total
        if chunk.first_position == 0:
            self.first = chunk.first
        self.last = chunk.last
        self.tokens += chunk.count
        if chunk.rows is not None:
            self.rows[chunk.first_position] = chunk.rows

    def result(
        self,
        defaults: PoolerConfig,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> torch.Tensor:
        """The pooled vector, cut to ``dimensions`` and normalized as asked; for ``classify``, the head's
        logits, as probabilities unless ``activation`` is off. Per-token types give one such row per kept
        token (``[rows, width]``).

        Raises:
            ValueError: ``classify`` for a model without a classification head.
        """
        kind = self.params.pooling_type or defaults.pooling_type
        assert self.total is not None and self.last is not None
        if kind in ("ALL", "STEP"):
            return self._per_token(kind, defaults, head, prompt_token_ids or [])
        if kind == "MEAN":
            vector = self.total / self.tokens
        elif kind == "CLS":
            assert self.first is not None
            vector = self.first
        else:
            vector = self.last
        if self.params.task == "classify":
            if head is None:
                raise ValueError("the model has no classification head")
            logits = head(vector).float().cpu()
            if not self.params.activation:
                return logits
            return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)
        if self.params.dimensions is not None:
            vector = vector[: self.params.dimensions]
        normalize = defaults.normalize if self.params.normalize is None else self.params.normalize
        return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector

    def _per_token(
        self,
        kind: str,
        defaults: PoolerConfig,
        head: Callable[[torch.Tensor], torch.Tensor] | None,
        prompt_token_ids: list[int],
    ) -> torch.Tensor:
        params = self.params
        rows = torch.cat([self.rows[start] for start in sorted(self.rows)])
        if kind == "STEP" and params.step_tag_id is not None:
            keep = torch.tensor(prompt_token_ids[: rows.shape[0]]) == params.step_tag_id
            rows = rows[keep]
        if params.task == "classify":
            if head is None:
                raise ValueError("the model has no classification head")
            logits = head(rows).float().cpu()
            if params.returned_token_ids is not None:
                logits = logits[:, params.returned_token_ids]
            if not params.activation:
                return logits
            return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
        if params.returned_token_ids is not None:
            rows = rows[:, params.returned_token_ids]
        elif params.dimensions is not None:
            rows = rows[:, : params.dimensions]
        normalize = defaults.normalize if params.normalize is None else params.normalize
        return torch.nn.functional.normalize(rows, dim=-1) if normalize else rows

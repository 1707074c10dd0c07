"""Pooling a step's hidden states: which rows belong to which pooling request, their per-chunk
reduction on the device, and the finished vector (dimensions cut, then normalized) once a prompt is done.

A prompt may arrive in several chunks (chunked prefill): each chunk contributes a partial sum (MEAN), its
first row (CLS, the chunk at position 0) or its last row (LAST, the chunk that ends the prompt), or, for
the per-token types (ALL, STEP), all its rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.host_copy import copy_to_device_async, copy_to_host_async
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


@dataclass(slots=True)
class PooledStep:
    """A step's pooled chunks, their reductions on their way to the host (the step's next work is issued
    before they are read: :meth:`chunks` waits for them)."""

    rows: list[PoolRows]
    #: float32 ``[3, chunks, width]``: each chunk's sum, first row and last row (host; copy in flight)
    _reduced: torch.Tensor
    #: the per-token chunks' rows one after another, float32 (host; copy in flight), None without any
    _per_token: torch.Tensor | None
    _ready: Any

    def ending(self) -> list[Sequence]:
        """The sequences whose prompt this step's chunk ends."""
        return [r.seq for r in self.rows if r.first_position + r.count == len(r.seq.prompt_token_ids)]

    def chunks(self) -> list[PooledChunk]:
        """Each chunk's contribution, once on the host."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        total, first, last = self._reduced
        out = []
        offset = 0
        for i, r in enumerate(self.rows):
            every = None
            if r.seq.pooling.per_token:
                assert self._per_token is not None
                every = self._per_token[offset : offset + r.count]
                offset += r.count
            out.append(PooledChunk(r.seq, r.first_position, r.count, total[i], first[i], last[i], every))
        return out


def pooled_row_index(rows: list[PoolRows]) -> list[int] | None:
    """The one row of the step each chunk's pooling reads, when each reads one: its first for ``CLS``, its
    last for ``LAST`` (a chunk that does not hold the prompt's first or last row gives one that is read
    and then overwritten or ignored); None when any chunk needs more (``MEAN``, the per-token types) or
    its pooling type is not resolved yet."""
    index = []
    for r in rows:
        kind = r.seq.pooling.pooling_type
        if kind == "CLS":
            index.append(r.first_row)
        elif kind == "LAST":
            index.append(r.first_row + r.count - 1)
        else:
            return None
    return index


def pool_chunks(hidden: torch.Tensor, rows: list[PoolRows], one_row_each: bool = False) -> PooledStep:
    """Each chunk's reduction of ``hidden [tokens, width]`` in float32, in a few device operations for the
    whole step, and one copy to the host that the caller need not wait for.

    ``one_row_each``: ``hidden`` holds only the row each chunk's pooling reads (:func:`pooled_row_index`,
    in order), which then stands for the chunk's sum, first and last rows alike."""
    if one_row_each:
        picked = hidden.float()
        reduced, ready = copy_to_host_async(torch.stack([picked, picked, picked]))
        return PooledStep(rows, reduced, None, ready)
    counts = [r.count for r in rows]
    firsts = [r.first_row for r in rows]
    lasts = [f + c - 1 for f, c in zip(firsts, counts, strict=True)]
    device = hidden.device
    meta = copy_to_device_async([firsts, lasts], device)
    adjacent = all(firsts[i + 1] == lasts[i] + 1 for i in range(len(rows) - 1))
    if adjacent and len(set(counts)) == 1:  # a batch of equal prompts: one reshaped sum
        block = hidden[firsts[0] : lasts[-1] + 1].float()
        total = block.view(len(rows), counts[0], -1).sum(dim=1)
    else:
        if adjacent:
            block = hidden[firsts[0] : lasts[-1] + 1]
        else:
            index = [row for f, c in zip(firsts, counts, strict=True) for row in range(f, f + c)]
            block = hidden[copy_to_device_async(index, device)]
        # each row added into its chunk's sum by index: sizes all known on the host, so nothing waits for
        # the device (a segment reduction over device lengths may read them back)
        chunk_of_row = copy_to_device_async([i for i, c in enumerate(counts) for _ in range(c)], device)
        total = torch.zeros((len(rows), hidden.shape[1]), dtype=torch.float32, device=device)
        total.index_add_(0, chunk_of_row, block.float())
    reduced, ready = copy_to_host_async(torch.stack([total, hidden[meta[0]].float(), hidden[meta[1]].float()]))
    per_token = None
    wanted = [r for r in rows if r.seq.pooling.per_token]
    if wanted:
        every = torch.cat([hidden[r.first_row : r.first_row + r.count] for r in wanted]).float()
        per_token, ready_rows = copy_to_host_async(every)
        ready = ready_rows if ready_rows is not None else ready  # recorded after the first: waits for both
    return PooledStep(rows, reduced, per_token, ready)


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
        if kind in ("ALL", "STEP"):
            return self._per_token(kind, defaults, head, prompt_token_ids or [])
        if self.params.task == "classify":
            if head is None:
                raise ValueError("the model has no classification head")
            logits = head(self._pooled(kind)).float().cpu()
            if not self.params.activation:
                return logits
            return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)
        vector = self.embedding(defaults)
        assert vector is not None
        return torch.nn.functional.normalize(vector, dim=-1) if self.normalizes(defaults) else vector

    def embedding(self, defaults: PoolerConfig) -> torch.Tensor | None:
        """The pooled vector cut to ``dimensions``, before any normalization; None for a per-token type or
        a ``classify`` request (whose :meth:`result` is not one vector)."""
        kind = self.params.pooling_type or defaults.pooling_type
        if kind in ("ALL", "STEP") or self.params.task == "classify":
            return None
        vector = self._pooled(kind)
        return vector if self.params.dimensions is None else vector[: self.params.dimensions]

    def normalizes(self, defaults: PoolerConfig) -> bool:
        """Whether :meth:`result` normalizes the :meth:`embedding`."""
        return defaults.normalize if self.params.normalize is None else self.params.normalize

    def _pooled(self, kind: str) -> torch.Tensor:
        assert self.total is not None and self.last is not None
        if kind == "MEAN":
            return self.total / self.tokens
        if kind == "CLS":
            assert self.first is not None
            return self.first
        return self.last

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


def pooled_results(
    states: list[PoolingState],
    defaults: PoolerConfig,
    head: Callable[[torch.Tensor], torch.Tensor] | None,
    prompts: list[list[int]],
) -> list[torch.Tensor]:
    """:meth:`PoolingState.result` of each state, the embeddings to normalize normalized together: one
    operation per vector width for a step's texts, not one each (on the host, 18 us a text).

    Raises:
        ValueError: as :meth:`PoolingState.result`.
    """
    out: list[torch.Tensor] = []
    to_normalize: dict[int, list[int]] = {}
    for i, (state, prompt) in enumerate(zip(states, prompts, strict=True)):
        vector = state.embedding(defaults)
        if vector is None:
            out.append(state.result(defaults, head, prompt))
            continue
        out.append(vector)
        if state.normalizes(defaults):
            to_normalize.setdefault(vector.shape[-1], []).append(i)
    for rows in to_normalize.values():
        normed = torch.nn.functional.normalize(torch.stack([out[i] for i in rows]), dim=-1)
        for i, vector in zip(rows, normed, strict=True):
            out[i] = vector
    return out

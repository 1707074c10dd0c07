"""The EAGLE proposer: a one-layer head reads the target's hidden states and proposes its greedy
continuation of each decoding sequence.

Head position ``p`` pairs the token at ``p + 1`` with the target's hidden state at ``p`` (the state that
predicted that token), so the head keeps a mirror of each proposing sequence whose tokens are the target's
shifted by one, in a KV pool of its own. Proposing first catches the mirror up over every position whose
pair is known since its last round (the target's rows, kept beside its KV blocks by
:class:`~engine.speculative.eagle_hidden.HiddenStore`; the last of them samples the first proposal), however
many steps ran without proposals in between, then decodes: each later position pairs the
previous proposal with the head's own output at the position before. Only the KV of positions computed
from the target's rows is kept afterwards: a draft position's KV was computed from the head's own hidden
state, so it is recomputed from the target's once verified. Proposals are a point mass (the head's argmax),
so rejection sampling keeps the target's distribution exactly at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.block_manager import BlockManager, NoFreeBlocksError
from engine.model_runner import ModelRunner
from engine.models.eagle_head import EagleHead
from engine.models.mtp_layer import MtpLayer
from engine.sampling.params import SamplingParams
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from engine.speculative.eagle_hidden import HiddenStore


@dataclass(slots=True)
class EagleParts:
    """What the head runs on.

    Attributes:
        runner: the head's runner over its own KV pool.
        block_manager: the head pool's block tables (one per mirrored sequence).
        head: the head model (its ``use_hidden`` input and ``last_hidden`` output): an EAGLE head, or the
            target's MTP layer (``method="mtp"``), which runs as an EAGLE-1 head does.
        store: the target's hidden states beside its KV blocks (the target's runner fills it).
        model_path: the head's folder (for logs and errors).
        max_num_batched_tokens: the most rows one head forward takes (catching up runs in chunks).
        max_model_len: the context the head's rotary covers.
    """

    runner: ModelRunner
    block_manager: BlockManager
    head: EagleHead | MtpLayer
    store: HiddenStore
    model_path: str
    max_num_batched_tokens: int
    max_model_len: int


class EagleProposer:
    """Proposes each sequence's next tokens with the EAGLE head.

    Args:
        parts: the head, its runner and pool, and the target's kept hidden states.
    """

    def __init__(self, parts: EagleParts) -> None:
        self.parts = parts
        #: each sequence's mirror in the head's pool (tokens shifted by one), by the target's seq id
        self.mirrors: dict[int, Sequence] = {}
        #: the head's own sampling: its argmax, nothing processed
        self.params = SamplingParams(temperature=0.0, max_tokens=None)

    def propose(self, rooms: dict[int, tuple[Sequence, int]]) -> dict[int, list[int]]:
        """The head's greedy continuation of each sequence, up to its room.

        Args:
            rooms: by seq id, the target's sequence and the most tokens to propose for it (positive).

        Returns:
            By seq id, the proposals (empty where the head's pool could not hold the sequence).
        """
        proposals: dict[int, list[int]] = {seq_id: [] for seq_id in rooms}
        ready: list[tuple[int, Sequence, int]] = []
        for seq_id, (seq, room) in rooms.items():
            mirror = self._sync(seq)
            if mirror is not None and self._reserve(mirror, mirror.num_tokens + room, keep=rooms):
                last = mirror.num_tokens - 1
                # the first proposal is sampled after the last position: it is always computed this round
                mirror.num_computed_tokens = min(mirror.num_computed_tokens, last)
                ready.append((seq_id, mirror, last))
        if not ready:
            return proposals
        tokens, hidden = self._catch_up([(m, last) for _, m, last in ready], sample=True)
        active = []
        for (seq_id, mirror, _), token in zip(ready, tokens):
            proposals[seq_id].append(token)
            mirror.output_token_ids.append(token)
            if len(proposals[seq_id]) < rooms[seq_id][1]:
                active.append((seq_id, mirror))
        # the rows of the sequences still proposing, in the order of ``active``
        hidden = hidden[[i for i, (seq_id, _, _) in enumerate(ready) if len(proposals[seq_id]) < rooms[seq_id][1]]]
        while active:
            tokens, hidden = self._decode([m for _, m in active], hidden)
            still, keep_rows = [], []
            for i, ((seq_id, mirror), token) in enumerate(zip(active, tokens)):
                proposals[seq_id].append(token)
                mirror.output_token_ids.append(token)
                if len(proposals[seq_id]) < rooms[seq_id][1]:
                    still.append((seq_id, mirror))
                    keep_rows.append(i)
            active, hidden = still, hidden[keep_rows]
        for _, mirror, last in ready:
            # draft positions read the head's own hidden states: recomputed from the target's once verified
            mirror.num_computed_tokens = last + 1
        return proposals

    def finished(self, seq_id: int) -> None:
        """Free an ended sequence's mirror and its blocks."""
        if self.mirrors.pop(seq_id, None) is not None:
            self.parts.block_manager.free(seq_id)

    def _sync(self, seq: Sequence) -> Sequence | None:
        """The mirror of ``seq`` with the target's tokens (shifted by one); None while the target's last
        token is still on the device."""
        if seq.output_token_ids and seq.output_token_ids[-1] == PENDING_TOKEN:
            return None
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None or mirror.request_id != seq.request_id:
            if mirror is not None:
                self.finished(seq.seq_id)
            mirror = Sequence(seq.seq_id, seq.request_id, 0, seq.prompt_token_ids[1:], self.params, 0)
            mirror.status = SequenceStatus.RUNNING
            self.mirrors[seq.seq_id] = mirror
        # the target's tokens never change behind its last one, so the head's KV stays valid up to the
        # positions it computed from the target's rows (proposals are cut off at the end of each round)
        mirror.output_token_ids = list(seq.output_token_ids)
        return mirror

    def _reserve(self, mirror: Sequence, num_tokens: int, keep: Any) -> bool:
        """Grow the mirror's table to ``num_tokens``; when the pool is short, drop the mirrors of
        sequences not in ``keep`` first. False: it still does not fit (the sequence waits this round)."""
        bm = self.parts.block_manager
        for attempt in range(2):
            try:
                bm.allocate(mirror.seq_id, num_tokens)
                return True
            except NoFreeBlocksError:
                if attempt == 0:
                    for seq_id in [s for s in self.mirrors if s not in keep]:
                        self.finished(seq_id)
        return False

    def _catch_up(self, due: list[tuple[Sequence, int]], sample: bool) -> tuple[list[int], torch.Tensor]:
        """Compute each mirror's KV through position ``last`` from the target's rows, in chunks of the
        batch budget.

        Args:
            due: each mirror with the last position to compute.
            sample: sample after each mirror's last position (its first proposal).

        Returns:
            The sampled token and the head's output row at that position for each mirror, in order (no
            tokens and an empty tensor when not sampling).
        """
        parts, head = self.parts, self.parts.head
        budget = parts.max_num_batched_tokens
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        while True:
            step = SchedulerOutput()
            hidden: list[torch.Tensor] = []
            sampled_rows: list[int] = []
            left, offset = budget, 0
            for mirror, last in due:
                behind = last + 1 - mirror.num_computed_tokens
                if behind <= 0 or left <= 0:
                    continue
                n = min(behind, left)
                first = mirror.num_computed_tokens
                ends = sample and n == behind
                step.scheduled.append(ScheduledSequence(mirror, n, ends))
                hidden.append(parts.store.gather(mirror.seq_id, first, first + n - 1))
                offset += n
                if ends:
                    sampled_rows.append(offset - 1)
                left -= n
            if not step.scheduled:
                break
            head.use_hidden(torch.cat(hidden))
            launched = parts.runner.launch(step, None)
            result = launched.resolve()
            for item in step.scheduled:
                item.seq.num_computed_tokens += item.num_new_tokens
            if result is not None:
                tokens.extend(result.token_ids)
                assert head.last_hidden is not None
                rows.append(head.last_hidden[sampled_rows])
        if not rows:
            return tokens, torch.empty(0)
        # the chunks sampled their mirrors in the order of ``due``: each mirror samples in its last chunk,
        # and a chunk takes the mirrors in order, so the concatenation follows ``due``
        return tokens, torch.cat(rows)

    def _decode(self, mirrors: list[Sequence], hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """One head position after each mirror's last proposal, reading the head's own hidden state."""
        head = self.parts.head
        step = SchedulerOutput([ScheduledSequence(m, m.num_tokens - m.num_computed_tokens, True) for m in mirrors])
        head.use_hidden(hidden)
        result = self.parts.runner.launch(step, None).resolve()
        assert result is not None and head.last_hidden is not None
        for mirror in mirrors:
            mirror.num_computed_tokens = mirror.num_tokens
        return list(result.token_ids), head.last_hidden

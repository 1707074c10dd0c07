"""The draft-model proposer: a smaller model of the same vocabulary runs beside the target, with a KV
cache of its own, and proposes its greedy continuation of each decoding sequence.

The draft keeps a mirror of every sequence it proposes for: the target's tokens followed by the draft's
own proposals. After the target verifies a step, the mirror's tokens are reset to the target's, and only
the KV of the tokens both agree on is kept (the accepted proposals); the rest is recomputed by the next
proposal's first forward, together with the target's bonus token. Proposals are a point mass (the draft's
argmax), so the target's rejection sampling keeps its own distribution exactly at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.block_manager import BlockManager, NoFreeBlocksError
from engine.model_runner import ModelRunner
from engine.sampling.params import SamplingParams
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class DraftParts:
    """What the draft runs on.

    Attributes:
        runner: the draft model's runner over its own KV pool.
        block_manager: the draft pool's block tables (one per mirrored sequence).
        model_path: where the draft was loaded from (for logs and errors).
        max_num_batched_tokens: the most tokens one draft forward takes (catching up long prompts runs
            in chunks of this size).
        max_model_len: the draft's context length: it proposes nothing for a longer sequence.
    """

    runner: ModelRunner
    block_manager: BlockManager
    model_path: str
    max_num_batched_tokens: int
    max_model_len: int


class DraftModelProposer:
    """Proposes each sequence's next tokens with the draft model.

    Args:
        parts: the draft's runner and block tables.
    """

    def __init__(self, parts: DraftParts) -> None:
        self.parts = parts
        #: each proposing sequence's mirror in the draft's cache, by the target's seq id
        self.mirrors: dict[int, Sequence] = {}
        #: the draft's own sampling: its argmax, nothing processed (penalties and biases are the target's)
        self.params = SamplingParams(temperature=0.0, max_tokens=None)

    def propose(self, rooms: dict[int, tuple[Sequence, int]]) -> dict[int, list[int]]:
        """The draft's greedy continuation of each sequence, up to its room.

        Args:
            rooms: by seq id, the target's sequence and the most tokens to propose for it (positive).

        Returns:
            By seq id, the proposals (empty for a sequence the draft's pool could not hold).
        """
        active: list[tuple[int, Sequence]] = []
        for seq_id, (seq, _) in rooms.items():
            mirror = self._sync(seq)
            if self._reserve(mirror, mirror.num_tokens + rooms[seq_id][1], keep=rooms):
                active.append((seq_id, mirror))
        proposals: dict[int, list[int]] = {seq_id: [] for seq_id in rooms}
        self._catch_up([m for _, m in active])
        while active:
            tokens = self._decode([m for _, m in active])
            still: list[tuple[int, Sequence]] = []
            for (seq_id, mirror), token in zip(active, tokens):
                proposals[seq_id].append(token)
                mirror.output_token_ids.append(token)
                if len(proposals[seq_id]) < rooms[seq_id][1]:
                    still.append((seq_id, mirror))
            active = still
        return proposals

    def finished(self, seq_id: int) -> None:
        """Free an ended sequence's mirror and its blocks."""
        if self.mirrors.pop(seq_id, None) is not None:
            self.parts.block_manager.free(seq_id)

    def _sync(self, seq: Sequence) -> Sequence:
        """The mirror of ``seq``, its tokens reset to the target's, its cache cut to what they share."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None or mirror.prompt_token_ids != seq.prompt_token_ids:
            if mirror is not None:
                self.finished(seq.seq_id)
            mirror = Sequence(seq.seq_id, seq.request_id, 0, list(seq.prompt_token_ids), self.params, 0)
            mirror.status = SequenceStatus.RUNNING
            self.mirrors[seq.seq_id] = mirror
        old, new = mirror.output_token_ids, seq.output_token_ids
        same = 0
        limit = min(len(old), len(new))
        while same < limit and old[same] == new[same]:
            same += 1
        mirror.output_token_ids = list(new)
        # the last token is always fed again, even when its KV is in the cache already (a step that
        # verified none of the proposals, say for want of blocks, sampled the draft's own first one): its
        # forward gives the next proposal
        mirror.num_computed_tokens = min(
            mirror.num_computed_tokens, len(mirror.prompt_token_ids) + same, mirror.num_tokens - 1
        )
        return mirror

    def _reserve(self, mirror: Sequence, num_tokens: int, keep: dict[int, Any]) -> bool:
        """Grow the mirror's table to ``num_tokens``; when the pool is short, drop the mirrors of sequences
        not proposing this step first. False: it still does not fit (no proposals for it this step)."""
        bm = self.parts.block_manager
        try:
            bm.allocate(mirror.seq_id, num_tokens)
            return True
        except NoFreeBlocksError:
            for seq_id in [s for s in self.mirrors if s not in keep]:
                self.finished(seq_id)
        try:
            bm.allocate(mirror.seq_id, num_tokens)
            return True
        except NoFreeBlocksError:
            return False

    def _catch_up(self, mirrors: list[Sequence]) -> None:
        """Compute every mirror's KV up to its last token (prompts, the target's bonus tokens), in chunks
        of the batch budget; the last token is left for the first decode, which samples after it."""
        budget = self.parts.max_num_batched_tokens
        while True:
            step = SchedulerOutput()
            left = budget
            for mirror in mirrors:
                behind = mirror.num_tokens - 1 - mirror.num_computed_tokens
                if behind <= 0 or left <= 0:
                    continue
                n = min(behind, left)
                step.scheduled.append(ScheduledSequence(mirror, n, False))
                left -= n
            if not step.scheduled:
                return
            self.parts.runner.launch(step, None)
            for item in step.scheduled:
                item.seq.num_computed_tokens += item.num_new_tokens

    def _decode(self, mirrors: list[Sequence]) -> list[int]:
        """One draft token after each mirror's last token."""
        step = SchedulerOutput([ScheduledSequence(m, m.num_tokens - m.num_computed_tokens, True) for m in mirrors])
        result = self.parts.runner.launch(step, None).resolve()
        assert result is not None
        for mirror in mirrors:
            mirror.num_computed_tokens = mirror.num_tokens
        return list(result.token_ids)

"""Continuous batching under a per-step token budget.

Every step decides "how many tokens of which sequence run now". Running sequences come first (a decode is
one token, an unfinished prefill continues with the next chunk), then waiting sequences are admitted while
the token budget, the sequence limit and the free KV blocks allow. A long prompt is split across steps
(chunked prefill). When a running sequence cannot get a block, the youngest running sequence is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed later; nothing is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    """``num_new_tokens`` tokens of ``seq`` starting at ``seq.num_computed_tokens`` run this step."""

    seq: Sequence
    num_new_tokens: int
    #: whether this chunk reaches the end of the sequence, so a token is sampled after it
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
        return cls(seq, num_new_tokens, seq.num_computed_tokens + num_new_tokens == seq.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Chooses the work of each step.

    Args:
        config: token budget and sequence limit.
        block_manager: the KV block bookkeeping shared with the engine.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.seq_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        # Oldest first, so preemption takes from the back (the youngest).
        self.running.sort(key=lambda s: s.arrival)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + n
            while not self.block_manager.can_allocate(seq.seq_id, target):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: everything younger is gone too
            self.block_manager.allocate(seq.seq_id, target)
            out.scheduled.append(ScheduledSequence.of(seq, n))
            scheduled_ids.add(seq.seq_id)
            budget -= n
            i += 1
        if out.preempted:
            return out  # memory is tight: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + n
            # Keep one block per running sequence spare so admitting a prompt does not immediately force
            # a preemption at the next decode step.
            if not self.block_manager.can_allocate(seq.seq_id, target, reserve=len(self.running) if self.running else 0):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq.seq_id, target)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence.of(seq, n))
            budget -= n
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free ``seq``'s blocks and requeue it at the front; it recomputes prompt and output later."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        # A sequence scheduled earlier in this step cannot be the victim: victims are taken from the back
        # and the loop stops once it reaches the sequence being scheduled.

    def advance(self, output: SchedulerOutput) -> None:
        """Record that the scheduled tokens were computed."""
        for item in output.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens

"""Continuous batching under a per-step token budget.

Every step decides "how many tokens of which sequence run now". Running sequences come first, decodes
before prefill chunks so that a long prompt arriving never stalls the tokens of running requests; then
waiting sequences are admitted (most important first, ties by age) while the token budget, the sequence
limit and the free KV blocks allow. A long prompt is split across steps (chunked prefill). A new sequence
first takes the cached blocks of its longest cached prefix. When a running sequence cannot get a block, the
least important running sequence (the youngest among equals) is preempted: its blocks are freed and it goes
back to the queue, to be recomputed later; nothing is dropped. Waiting sequences age, gaining a priority
level every ``priority_aging_steps`` steps, so none starves.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_allocator import BlockAllocator
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.hybrid_block_manager import HybridBlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    """``num_new_tokens`` tokens of ``seq`` starting at ``seq.num_computed_tokens`` run this step."""

    seq: Sequence
    num_new_tokens: int
    #: whether this chunk reaches the end of the sequence, so a token is sampled after it
    samples: bool
    #: of ``num_new_tokens``, the last ones that are proposals (``seq.spec_tokens``) to verify
    num_spec: int = 0

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
        return cls(seq, num_new_tokens, seq.num_computed_tokens + num_new_tokens == seq.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    #: (source, destination) block copies to make before the step runs (copy-on-write)
    copies: list[tuple[int, int]] = field(default_factory=list)
    #: (device block, host block) pairs to copy out, then (host block, device block) pairs to copy in;
    #: the runner does swap-outs, then copies, then swap-ins, then the forward
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class SchedulerInterface(abc.ABC):
    """The contract between the engine and a scheduler.

    One thread (the engine's) calls every method. A sequence is in at most one of the scheduler's sets
    at a time (waiting, running, swapped), or in none: finished, or parked by its owner (beam search).
    Per step the engine calls :meth:`schedule`, runs the step, then :meth:`advance`; between steps it
    adds, parks and removes sequences. The scheduler owns ``seq.status`` and ``seq.num_computed_tokens``
    of the sequences it holds, and the block tables of the shared block manager; it never reads or writes
    a sequence's output state (text, logprobs, finish reason) and never appends tokens.
    """

    @abc.abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue a sequence to be admitted (prefilled) by a later :meth:`schedule`.

        Called by the engine for a new request's first sequence and by beam search for a group's root;
        also by the scheduler itself to requeue a sequence preempted by recomputation.

        Pre: ``seq`` is in none of the scheduler's sets, holds no blocks and has
        ``num_computed_tokens == 0`` (its cached prefix is looked up when it is admitted).
        Post: ``seq.status`` is WAITING and ``seq`` is waiting; its age counts from the current step.
        """

    @abc.abstractmethod
    def add_running(self, seq: Sequence) -> None:
        """Put a sequence whose KV is already in its block table straight into the running set.

        Called for a fork: an ``n > 1`` request's siblings once the first sequence prefilled, and a
        beam's children.

        Pre: ``seq`` is in none of the scheduler's sets; its block table covers
        ``seq.num_computed_tokens`` tokens (the caller forked it in the block manager).
        Post: ``seq.status`` is RUNNING and ``seq`` runs from the next :meth:`schedule`; nothing is
        allocated now.
        """

    @abc.abstractmethod
    def park(self, seq: Sequence) -> None:
        """Take a running sequence out of the running set, keeping its blocks.

        Called by beam search once a beam sampled, to hold it until its whole group has sampled; the
        owner later forks it and calls :meth:`remove`.

        Pre: ``seq`` is running.
        Post: ``seq`` is in none of the scheduler's sets; its status and block table are unchanged.
        """

    @abc.abstractmethod
    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever set holds it and free its device and host blocks.

        Called by the engine when a sequence finishes or its request is aborted, and by beam search
        for beams it ends. Idempotent; a sequence in no set (parked, or never scheduled) only has its
        blocks freed.

        Post: ``seq`` is in none of the scheduler's sets and holds no blocks. ``seq.status`` is left to
        the caller (who marks it FINISHED).
        """

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Choose the tokens of the next step and make room for them.

        Called by the engine once per step, before the step runs.

        May mutate: the sets (admitting, preempting, swapping), the scheduled sequences' status and
        ``num_computed_tokens`` (a cached prefix taken on admission, or reset by preemption), the block
        tables (growth, copy-on-write copies, frees of preempted sequences). It never changes token ids.

        Returns:
            The scheduled ``(sequence, num_new_tokens)`` rows, each starting at the sequence's
            ``num_computed_tokens``, within the token budget and the sequence limit, with every block
            their KV is written to allocated and private; and the block copies and swaps the runner must
            make before the forward, in the order swap-out, copy, swap-in.
        """

    @abc.abstractmethod
    def advance(self, output: SchedulerOutput) -> None:
        """Record that a step's scheduled tokens are in the KV cache.

        Called by the engine after the step of ``output`` was issued, and after the tokens sampled by
        the step before were appended (so every full block's token ids are final).

        Pre: ``output`` is the latest :meth:`schedule` result.
        Post: each scheduled sequence not finished meanwhile has ``num_computed_tokens`` raised by its
        row's token count, and its newly full blocks are indexed in the prefix cache.
        """

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Sequences waiting to be admitted (the engine's queue limit counts them)."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Whether any sequence is waiting, running or swapped out."""


class Scheduler(SchedulerInterface):
    """Chooses the work of each step (see :class:`SchedulerInterface` for the contract).

    Args:
        config: token budget, sequence limit, aging, preemption mode.
        block_manager: the KV block bookkeeping shared with the engine (one table per sequence, or one per
            KV group: such a manager never swaps).
        num_host_blocks: size of the platform's host swap pool; 0 means preemption always recomputes.
    """

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager | HybridBlockManager, num_host_blocks: int = 0
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        use_swap = config.preemption_mode != "recompute" and num_host_blocks > 0
        if config.preemption_mode == "swap" and isinstance(block_manager, HybridBlockManager):
            raise ValueError("preemption_mode='swap' is not supported for models mixing sliding-window and global layers")
        if config.preemption_mode == "swap" and not use_swap:
            raise ValueError("preemption_mode='swap' needs a platform block cache that supports swapping")
        use_swap = use_swap and isinstance(block_manager, BlockManager)
        self.host_allocator = BlockAllocator(num_host_blocks) if use_swap else None
        #: per swapped-out sequence, the host block of each table entry (None: released out of the window)
        self.host_tables: dict[int, list[int | None]] = {}
        self.num_preemptions = 0
        self.num_swaps_out = 0
        self.num_steps = 0
        #: the most distinct LoRA adapters among running sequences (``max_loras``; None: LoRA off)
        self.max_loras: int | None = None
        self.clock: Callable[[], float] = time.monotonic
        #: when the last step that admitted prompts was scheduled (None once its length is known)
        self._prompt_step_at: float | None = None
        #: how long that step took (until the next one was scheduled), for ``scheduler_delay_factor``
        self._last_prompt_latency = 0.0

    def add(self, seq: Sequence) -> None:
        """See :meth:`SchedulerInterface.add`."""
        seq.status = SequenceStatus.WAITING
        seq.enqueued_step = self.num_steps
        seq.enqueued_time = self.clock()
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """See :meth:`SchedulerInterface.add_running`."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def park(self, seq: Sequence) -> None:
        """See :meth:`SchedulerInterface.park`."""
        self.running.remove(seq)

    @property
    def num_waiting(self) -> int:
        """See :attr:`SchedulerInterface.num_waiting`."""
        return len(self.waiting)

    def has_work(self) -> bool:
        """See :meth:`SchedulerInterface.has_work`."""
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, seq: Sequence) -> None:
        """See :meth:`SchedulerInterface.remove`."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self._free_host(seq.seq_id)
        self.block_manager.free(seq.seq_id)

    def _free_host(self, seq_id: int) -> None:
        assert self.host_allocator is not None
        for block in self.host_tables.pop(seq_id, []):
            if block is not None:
                self.host_allocator.decref(block)

    def _waiting_key(self, seq: Sequence) -> tuple[float, int]:
        waited = self.num_steps - seq.enqueued_step
        return (seq.priority - waited / self.config.priority_aging_steps, seq.arrival)

    def schedule(self) -> SchedulerOutput:
        """See :meth:`SchedulerInterface.schedule`: running sequences first (decodes before prefill
        chunks), then swapped-out ones coming back, then waiting ones by aged priority."""
        self.num_steps += 1
        now = self.clock()
        if self._prompt_step_at is not None:
            self._last_prompt_latency = now - self._prompt_step_at
            self._prompt_step_at = None
        out = SchedulerOutput()
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        order = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.priority, s.arrival))
        windowed = bm.releases_blocks
        for seq in order:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.last_token_in_flight:
                continue  # preempted earlier in this step, or its last token is being computed
            n = min(seq.num_uncomputed_tokens, budget)
            start = seq.num_computed_tokens
            # a decode with proposals verifies them in the same step, room allowing
            spec = min(len(seq.spec_tokens), budget - 1) if seq.spec_tokens and n == 1 == seq.num_uncomputed_tokens else 0
            if spec and not bm.can_allocate(seq.seq_id, start + 1 + spec, num_computed=start):
                spec = 0  # memory is tight: decode without them rather than preempt for them
            if windowed:
                bm.release_out_of_window(seq.seq_id, start)
            if spec:
                out.copies.extend(bm.copies_for_write(seq.seq_id, start))
                bm.allocate(seq.seq_id, start + 1 + spec)
                out.scheduled.append(ScheduledSequence(seq, 1 + spec, True, spec))
                scheduled.add(seq.seq_id)
                budget -= 1 + spec
                continue
            if n == 1 and bm.has_private_slot(seq.seq_id, start):
                # a decode into a block it owns: nothing to allocate or copy (most rows of a big batch)
                out.scheduled.append(ScheduledSequence(seq, 1, start + 1 == seq.num_tokens))
                scheduled.add(seq.seq_id)
                budget -= 1
                continue
            while not bm.can_allocate(seq.seq_id, start + n, num_computed=start):
                candidates = [s for s in self.running if s.seq_id not in scheduled]
                victim = max(candidates, key=lambda s: (s.priority, s.arrival))
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            out.copies.extend(bm.copies_for_write(seq.seq_id, start))
            bm.allocate(seq.seq_id, start + n)
            out.scheduled.append(ScheduledSequence.of(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        if out.preempted:
            return out  # memory is tight: admit nobody new this step
        budget = self._swap_in(out, budget)
        if self.swapped:
            return out  # swapped sequences come back before anyone new is admitted
        if not self._admission_due(now, budget):
            return out
        admitted_before = len(out.scheduled)
        self._admit(out, budget)
        if len(out.scheduled) > admitted_before:
            self._prompt_step_at = now
        return out

    def _admission_due(self, now: float, budget: int) -> bool:
        """Whether waiting sequences may be admitted this step (``scheduler_delay_factor``)."""
        factor = self.config.scheduler_delay_factor
        if factor <= 0.0 or not self.waiting or not self.running:
            return True
        oldest = min(seq.enqueued_time for seq in self.waiting)
        if now - oldest >= factor * self._last_prompt_latency:
            return True
        # enough is waiting to fill the step: holding it back would only delay it
        return sum(seq.num_uncomputed_tokens for seq in self.waiting) >= budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        self.waiting.sort(key=self._waiting_key)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            index = self._first_admissible(self.waiting)
            if index is None:
                break  # every waiting sequence needs an adapter beyond max_loras
            seq = self.waiting[index]
            # a request scoring or pooling its prompt computes all of it: cached blocks would skip its rows
            if seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is None and seq.pooling is None:
                seq.num_computed_tokens = bm.match_prefix(
                    seq.seq_id, seq.token_slice(0, seq.num_tokens), seq.prefix_key
                )
                if not seq.output_token_ids and not seq.num_preemptions:
                    seq.num_cached_tokens = seq.num_computed_tokens
            n = min(seq.num_uncomputed_tokens, budget)
            if seq.whole_prompt and n < seq.num_uncomputed_tokens:
                break  # it waits for a step with room for all of it
            target = seq.num_computed_tokens + n
            # Keep one block per running sequence spare so admitting a prompt does not immediately force
            # a preemption at the next decode step.
            if not bm.can_allocate(seq.seq_id, target, reserve=len(self.running)):
                if seq.num_computed_tokens:  # give back the cached prefix it took; it may be evicted meanwhile
                    bm.free(seq.seq_id)
                    seq.num_computed_tokens = 0
                break
            self.waiting.pop(index)
            bm.allocate(seq.seq_id, target)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence.of(seq, n))
            budget -= n

    def _first_admissible(self, queue: list[Sequence]) -> int | None:
        """The first sequence of ``queue`` whose adapter may join the running ones (``max_loras``)."""
        if self.max_loras is None:
            return 0
        running = {s.lora_id for s in self.running if s.lora_id}
        room = len(running) < self.max_loras
        for index, seq in enumerate(queue):
            if not seq.lora_id or seq.lora_id in running or room:
                return index
        return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Move ``seq``'s blocks to host memory if there is room, else free them and requeue it to be
        recomputed later."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.spec_tokens = []
        out.preempted.append(seq)
        host = self.host_allocator
        bm = self.block_manager
        table = bm.block_tables.get(seq.seq_id, []) if host is not None and isinstance(bm, BlockManager) else []
        live = [block for block in table if block != bm.null_block]
        if host is not None and 0 < len(live) <= host.num_free_blocks:
            # entries released out of a sliding window stay released: only live blocks travel
            host_table = [None if block == bm.null_block else host.allocate() for block in table]
            out.swap_out.extend((d, h) for d, h in zip(table, host_table) if h is not None)
            self.host_tables[seq.seq_id] = host_table
            bm.free(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.num_swaps_out += 1
            return
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.add(seq)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Bring swapped sequences back, oldest first, while blocks, budget and the sequence limit allow."""
        bm = self.block_manager
        self.swapped.sort(key=lambda s: (s.priority, s.arrival))
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            index = self._first_admissible(self.swapped)
            if index is None:
                break
            seq = self.swapped[index]
            host_table = self.host_tables[seq.seq_id]
            n = min(seq.num_uncomputed_tokens, budget)
            # Its blocks come back first, then the blocks its next tokens need.
            extra = -(-(seq.num_computed_tokens + n) // bm.block_size) - len(host_table)
            live = [block is not None for block in host_table]
            if sum(live) + max(0, extra) > bm.num_free_blocks:
                break
            self.swapped.pop(index)
            device_blocks = bm.allocate_entries(seq.seq_id, live)
            out.swap_in.extend(zip([h for h in host_table if h is not None], device_blocks))
            self._free_host(seq.seq_id)
            bm.allocate(seq.seq_id, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence.of(seq, n))
            budget -= n
        return budget

    def advance(self, output: SchedulerOutput) -> None:
        """See :meth:`SchedulerInterface.advance`."""
        bm = self.block_manager
        for item in output.scheduled:
            seq = item.seq
            if seq.status is SequenceStatus.FINISHED:
                continue  # finished by the tokens of the step before (overlapped): its blocks are gone
            # proposals count as computed only once accepted (the engine adds those)
            seq.num_computed_tokens += item.num_new_tokens - item.num_spec
            bm.register_computed(seq.seq_id, seq.token_slice, seq.num_computed_tokens, seq.prefix_key)

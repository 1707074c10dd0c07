"""An engine's structured output: compiled grammars (cached, compiled off the engine's thread), one
matcher per constrained sequence, and each step's bitmask.

A step's masks are filled from the moment the step before it is accepted, on the backend's threads
(where it has some), while the engine's thread makes that step's outputs: at batch 256 over a 128k
vocabulary the fill took longer than the rest of a constrained step's extra host work.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from engine.structured_output.params import GrammarSpec, ReasoningGate, StructuredOutputsParams

if TYPE_CHECKING:
    from engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Gated:
    """A sequence's matcher held back while its model thinks.

    Attributes:
        matcher: at the grammar's start until the thinking ends.
        gate: when it ends.
        undecided: no token yet, and the model may answer at once or open a thinking block.
    """

    matcher: GrammarMatcher
    gate: ReasoningGate
    undecided: bool


@dataclass(slots=True)
class _NextMasks:
    """The masks of the next step, started when the step before it was accepted.

    Attributes:
        seqs: the sequence of each row (those the accepted step advanced; the rows of those it ended are
            filled but meaningless: they are released before the next step samples).
        lengths: each one's output length then: a row is stale once its sequence's output changed.
        bitmask: host int32 ``[len(seqs), words]``, every row filled once ``wait`` returned.
        wait: the end of the fill (the matchers must not advance before it).
    """

    seqs: list[Sequence]
    lengths: list[int]
    bitmask: torch.Tensor
    wait: Callable[[], None]


def _bit(position: int) -> int:
    """Bit ``position`` of an int32 bitmask word, as the signed value torch stores."""
    return (1 << position) - (1 << 32) if position == 31 else 1 << position


class StructuredOutputManager:
    """Compiles requests' constraints and keeps their sequences' matchers.

    The backend is built on the first constrained request (reading the vocabulary costs a fraction of a
    second that engines serving no such request never pay); so is the pool of compile threads.

    Args:
        make_backend: builds the backend for the engine's model and tokenizer.
        max_workers: grammars compiled at the same time.
        cache_size: compiled grammars kept, least recently used dropped first.
        pin_memory: allocate bitmasks in pinned memory (the logits live on an accelerator): the runner's
            copy to the device then neither copies them to pinned memory first nor waits for the device.
    """

    def __init__(
        self,
        make_backend: Callable[[], StructuredOutputBackend],
        max_workers: int = 2,
        cache_size: int = 256,
        pin_memory: bool = False,
    ) -> None:
        self._make_backend = make_backend
        self._pin_memory = pin_memory
        #: the next step's masks, being filled (see the module's docstring)
        self._next: _NextMasks | None = None
        self._max_workers = max_workers
        self._cache_size = cache_size
        # the HTTP layer may validate requests on worker threads while the engine's thread steps
        self._lock = threading.Lock()
        self._backend: StructuredOutputBackend | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._matchers: dict[int, GrammarMatcher] = {}
        #: sequences whose constraint waits for the end of their thinking (``ReasoningGate``)
        self._gated: dict[int, _Gated] = {}

    @property
    def backend(self) -> StructuredOutputBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def compile(self, params: StructuredOutputsParams) -> Future:
        """Check a constraint now and compile it in the background (once per distinct constraint).

        Returns:
            A future of the compiled grammar.

        Raises:
            ValueError: the constraint is invalid (or an earlier compilation of it failed); the message
                names the problem.
        """
        spec = params.spec()
        with self._lock:
            future = self._compiled.get(spec)
            if future is not None:
                self._compiled.move_to_end(spec)
        if future is None:
            backend = self.backend
            grammar = backend.parse(spec)  # syntax errors surface here, before the request is queued
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="grammar-compile")
                future = self._compiled.get(spec) or self._pool.submit(backend.compile, grammar)
                self._compiled[spec] = future
                while len(self._compiled) > self._cache_size:
                    self._compiled.popitem(last=False)  # a request still waiting on it holds its future
        if future.done() and future.exception() is not None:
            raise ValueError(str(future.exception()))
        return future

    def start(self, sequences: Iterable[Sequence], compiled: object) -> None:
        """Give each sequence its own matcher at the grammar's start (``n > 1`` siblings diverge); a
        constraint with a reasoning gate holds its matcher back until the thinking ends."""
        backend = self.backend
        for seq in sequences:
            matcher = backend.make_matcher(compiled)
            constraint = seq.params.structured_outputs
            gate = constraint.reasoning_gate if constraint is not None else None
            if gate is None:
                self._matchers[seq.seq_id] = matcher
            else:
                self._gated[seq.seq_id] = _Gated(
                    matcher, gate, undecided=gate.optional_start_token is not None
                )

    def constrains(self, seq: Sequence) -> bool:
        return seq.seq_id in self._matchers or seq.seq_id in self._gated

    @property
    def num_matchers(self) -> int:
        """Sequences holding a matcher (tests check that finished requests hold none)."""
        return len(self._matchers) + len(self._gated)

    def fill_bitmask(self, targets: list[Sequence]) -> tuple[torch.Tensor, list[int]] | None:
        """The bitmask of a step's sampled rows: filled for the constrained rows, which are returned too.

        Rows whose masks were started when the step before was accepted are taken from there (the
        bitmask itself when the rows are the same sequences in the same order, as in steady decoding);
        the others are filled now. Rows not returned allow every token.

        A thinking row gets a row allowing every token: any mask keeps the step's tokens off the
        device's overlap, so the token that ends the thinking opens the grammar before the next step's
        mask is filled.

        Args:
            targets: the sequence of each logits row.

        Returns:
            ``(host int32 [len(targets), words], the constrained rows)``, or None when no row is constrained.
        """
        ready = self._settle()
        # sequences compare by identity: one pass in C
        if ready is not None and ready.seqs == targets:
            if ready.lengths == [len(seq.output_token_ids) for seq in targets]:
                return self._reuse(ready.bitmask, targets)
        return self._fill(targets, ready)

    def _reuse(self, bitmask: torch.Tensor, targets: list[Sequence]) -> tuple[torch.Tensor, list[int]] | None:
        """The started masks as the step's bitmask: their rows are these targets' rows, all filled."""
        matchers = self._matchers
        rows = [i for i, seq in enumerate(targets) if seq.seq_id in matchers]
        if len(rows) < len(targets):
            # released meanwhile (finished or aborted): the row allows everything, as an unconstrained one
            kept = set(rows)
            bitmask[[i for i in range(len(targets)) if i not in kept]] = -1
        return (bitmask, rows) if rows else None

    def _fill(
        self, targets: list[Sequence], ready: _NextMasks | None
    ) -> tuple[torch.Tensor, list[int]] | None:
        """A new bitmask: rows copied from the started masks where still current, the others filled now."""
        matchers, gated = self._matchers, self._gated
        started = {seq.seq_id: r for r, seq in enumerate(ready.seqs)} if ready is not None else {}
        rows: list[int] = []
        free: list[int] = []
        copy_to: list[int] = []
        copy_from: list[int] = []
        plain: list[GrammarMatcher] = []
        plain_rows: list[int] = []
        undecided: list[tuple[int, _Gated]] = []
        for i, seq in enumerate(targets):
            seq_id = seq.seq_id
            matcher = matchers.get(seq_id)
            if matcher is not None:
                rows.append(i)
                r = started.get(seq_id)
                if r is not None and ready is not None and ready.lengths[r] == len(seq.output_token_ids):
                    copy_to.append(i)
                    copy_from.append(r)
                else:
                    plain.append(matcher)
                    plain_rows.append(i)
                continue
            held = gated.get(seq_id)
            if held is None:
                free.append(i)
                continue
            rows.append(i)
            if held.undecided:
                undecided.append((i, held))
            else:
                free.append(i)  # thinking: every token
        if not rows:
            return None
        bitmask = self._allocate(len(targets))
        if free:
            bitmask[free] = -1
        if copy_to:
            assert ready is not None
            bitmask[copy_to] = ready.bitmask[copy_from]
        for i, held in undecided:
            # the grammar's first tokens, or the token that opens a thinking block
            held.matcher.fill_next_token_bitmask(bitmask, i)
            token = held.gate.optional_start_token
            assert token is not None
            bitmask[i, token // 32] |= _bit(token % 32)
        if plain:
            self.backend.fill_bitmasks(plain, bitmask, plain_rows)
        return bitmask, rows

    def _allocate(self, rows: int) -> torch.Tensor:
        """An unfilled host bitmask (every row is written before it is read), pinned if asked and possible."""
        shape = (rows, self.backend.bitmask_words)
        if self._pin_memory:
            try:
                return torch.empty(shape, dtype=torch.int32, pin_memory=True)
            except RuntimeError as exc:  # no accelerator torch can pin for
                logger.warning("structured output bitmasks stay in pageable memory: %s", exc)
                self._pin_memory = False
        return torch.empty(shape, dtype=torch.int32)

    def _settle(self) -> _NextMasks | None:
        """Take the started masks, once filled (the caller uses or drops them; a fill's error raises here)."""
        ready, self._next = self._next, None
        if ready is not None:
            ready.wait()
        return ready

    def accept(self, seq: Sequence, token_id: int) -> bool:
        """Advance the sequence's matcher by its sampled token (``seq.output_token_ids`` ends with it).

        Returns:
            Whether the grammar ends the sequence: it accepted its stop token, or (which the mask
            should make impossible) it refused the token, so nothing valid can follow.
        """
        self._settle()  # the started masks' fill reads the matchers: it ends before one advances
        gated = self._gated.get(seq.seq_id)
        if gated is not None:
            if gated.undecided:
                gated.undecided = False
                if token_id == gated.gate.optional_start_token:
                    return False  # thinking
                # answered at once: this token is the grammar's first
                del self._gated[seq.seq_id]
                self._matchers[seq.seq_id] = gated.matcher
            else:
                if gated.gate.is_reasoning_end(seq.output_token_ids):
                    # the grammar applies from the next token; the one that ended the thinking is not its
                    del self._gated[seq.seq_id]
                    self._matchers[seq.seq_id] = gated.matcher
                return False
        matcher = self._matchers[seq.seq_id]
        if not matcher.accept_token(token_id):
            logger.warning(
                "sequence %d sampled token %d, which its grammar refuses; ending it", seq.seq_id, token_id
            )
            return True
        return matcher.is_terminated()

    def accept_step(self, sequences: list[Sequence]) -> set[int]:
        """:meth:`accept` for a step's sequences at once (each one's last output token is its new one);
        sequences holding no matcher are skipped. The next step's masks of these sequences start then
        (see the module's docstring).

        Returns:
            The ids of the sequences whose grammar ends them.
        """
        self._settle()
        ended: set[int] = set()
        matchers = self._matchers
        if self._gated:
            plain: list[Sequence] = []
            for seq in sequences:
                if seq.seq_id in self._gated:
                    if self.accept(seq, seq.output_token_ids[-1]):
                        ended.add(seq.seq_id)
                elif seq.seq_id in matchers:
                    plain.append(seq)
        else:
            plain = [seq for seq in sequences if seq.seq_id in matchers]
        if not plain:
            return ended
        tokens = [seq.output_token_ids[-1] for seq in plain]
        advanced = [matchers[seq.seq_id] for seq in plain]
        backend = self.backend
        if backend.fills_in_background:
            # the next step's masks start now, on the backend's threads (see the module's docstring)
            bitmask = self._allocate(len(plain))
            stopped, wait = backend.start_step(advanced, tokens, bitmask)
            lengths = [len(seq.output_token_ids) for seq in plain]
            self._next = _NextMasks(plain, lengths, bitmask, wait)
        else:
            stopped = backend.advance_step(advanced, tokens)
        for i, accepted in stopped:
            if not accepted:
                logger.warning(
                    "sequence %d sampled token %d, which its grammar refuses; ending it",
                    plain[i].seq_id, tokens[i],
                )  # fmt: skip
            ended.add(plain[i].seq_id)
        return ended

    def release(self, sequences: Iterable[Sequence]) -> None:
        """Drop the matchers of sequences that finished or were aborted."""
        for seq in sequences:
            self._matchers.pop(seq.seq_id, None)
            self._gated.pop(seq.seq_id, None)

    def shutdown(self) -> None:
        """Stop the compile threads (compilations in progress finish; none start)."""
        try:
            self._settle()  # no fill of the masks left running on the backend's threads
        except RuntimeError as exc:  # the masks are not needed any more: their failure is only logged
            logger.warning("the next step's structured output masks failed: %s", exc)
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

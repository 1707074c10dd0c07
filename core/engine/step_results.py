"""The engine's host-side bookkeeping on either side of a step, mixed into
:class:`~engine.llm_engine.LLMEngine` so that ``llm_engine`` reads as the request lifecycle and the step loop.

Before a step, a request may only enter the scheduler once the waiting queue has room for all its sequences
and its grammar has compiled; after it, a step's tokens reach their sequences in the order that output
processing, the grammars and the speculator's proposals depend on.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError, QueueFullError
from engine.sequence import PENDING_TOKEN, SequenceStatus

if TYPE_CHECKING:
    from concurrent.futures import Future

    from engine.beam_search import BeamSearcher
    from engine.block_manager import BlockManager
    from engine.config import EngineConfig
    from engine.hybrid_block_manager import HybridBlockManager
    from engine.launched_step import LaunchedStep
    from engine.output_processor import OutputProcessor
    from engine.scheduler import Scheduler
    from engine.sequence import Request, Sequence
    from engine.speculative.speculator import Speculator
    from engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

#: how long an otherwise idle step waits for a grammar to compile before returning (seconds)
GRAMMAR_WAIT_S = 0.05

__all__ = ["RequestAdmission", "StepResults"]


class RequestAdmission:
    """Mixed into :class:`~engine.llm_engine.LLMEngine`: the waiting queue's limit, and the constrained
    requests that join the scheduler once their grammar has compiled."""

    config: EngineConfig
    scheduler: Scheduler
    beams: BeamSearcher
    structured: StructuredOutputManager
    output_processor: OutputProcessor
    _awaiting_grammar: dict[str, tuple[Request, Future]]
    _in_flight: LaunchedStep | None

    def _admit_compiled(self) -> list[Request]:
        """Queue the requests whose grammar compiled; end those whose compilation failed.

        Returns:
            The requests ended (finish reason ``"abort"``); their outputs go out with this step's.
        """
        if not self._awaiting_grammar:
            return []
        if not self.scheduler.has_work() and self._in_flight is None and not self.beams.groups:
            # nothing else to run: wait a little for a grammar rather than spin
            wait([f for _, f in self._awaiting_grammar.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        failed = []
        for request_id, (request, grammar) in list(self._awaiting_grammar.items()):
            if not grammar.done():
                continue
            del self._awaiting_grammar[request_id]
            try:
                self.structured.start(request.sequences, grammar.result())
            except ValueError as exc:
                logger.error("request %s: its grammar failed to compile: %s", request_id, exc)
                for seq in request.sequences:
                    seq.status = SequenceStatus.FINISHED
                    self.output_processor.state(seq).finish_reason = "abort"
                failed.append(request)
                continue
            self.scheduler.add(request.sequences[0])
        return failed

    def _admit(self, num_seqs: int, what: str) -> None:
        """Check a request of ``num_seqs`` sequences against the waiting queue's limit.

        Raises:
            InvalidRequestError: ``num_seqs`` exceeds the limit, so the request could never be queued.
            QueueFullError: it does not fit now.
        """
        limit = self.config.scheduler.max_waiting_requests
        if limit is None:
            return
        if num_seqs > limit:
            raise InvalidRequestError(
                f"{what} is {num_seqs}, but at most {limit} sequences may wait in this server's queue "
                "(max_waiting_requests), so the request could never be queued",
                param="n",
            )
        if self.scheduler.num_waiting + num_seqs > limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")


class StepResults:
    """Mixed into :class:`~engine.llm_engine.LLMEngine`: a launched step's sampled and verified tokens
    appended to their sequences, the siblings of a prefilled prompt forked, and the next proposals made."""

    scheduler: Scheduler
    block_manager: BlockManager | HybridBlockManager
    beams: BeamSearcher
    structured: StructuredOutputManager
    output_processor: OutputProcessor
    speculator: Speculator | None
    requests: dict[str, Request]

    def _take_samples(self, launched: LaunchedStep, touched: dict[str, Request]) -> None:
        """Append a step's sampled tokens to their sequences (replacing the placeholders of an overlapped
        step), advance their grammars together, then process each sequence's output."""
        result = launched.resolve()
        if result is None:
            if self.speculator is not None and launched.verified:
                self._take_verified(launched, touched)  # every row of the step was a verified decode
                self._propose([], launched)
            return
        taken: list[tuple[int, Sequence]] = []
        for i, seq in enumerate(launched.targets):
            if seq.is_finished:
                # finished or aborted while the step was in flight, or by the overlapped step before this
                # one, whose tokens were read after this step was scheduled
                continue
            if launched.overlapped:
                if not seq.output_token_ids or seq.output_token_ids[-1] != PENDING_TOKEN:
                    continue
                seq.output_token_ids.pop()
            if self.beams.owns(seq):
                self.beams.on_sampled(seq, result.top_logprobs[i])
                continue
            if seq.pending_forks:
                self._fork_siblings(seq)
            seq.output_token_ids.append(result.token_ids[i])
            taken.append((i, seq))
        grammar_ended = (
            self.structured.accept_step([seq for _, seq in taken]) if self.structured.num_matchers else ()
        )
        for i, seq in taken:
            if self.output_processor.process_token(seq, result, i, seq.seq_id in grammar_ended):
                # output processing found it finished: free its blocks
                seq.status = SequenceStatus.FINISHED
                self.scheduler.remove(seq)
                self.structured.release((seq,))
            request = self.requests.get(seq.request_id)
            if request is not None:
                touched[seq.request_id] = request
        if self.speculator is not None:
            self._take_verified(launched, touched)
            self._propose([s for _, s in taken], launched)

    def _take_verified(self, launched: LaunchedStep, touched: dict[str, Request]) -> None:
        """Append what each verified decode keeps (accepted proposals, then the target's own token), one
        token at a time through output processing, and count the accepted proposals as computed."""
        assert self.speculator is not None
        for seq, verified in launched.verified:
            if seq.is_finished:
                continue
            result = verified.result
            for i, token in enumerate(result.token_ids):
                seq.output_token_ids.append(token)
                if self.output_processor.process_token(seq, result, i):
                    seq.status = SequenceStatus.FINISHED
                    self.scheduler.remove(seq)
                    break
            else:
                seq.num_computed_tokens += verified.accepted
            request = self.requests.get(seq.request_id)
            if request is not None:
                touched[seq.request_id] = request
        self.speculator.record(v for _, v in launched.verified)

    def _propose(self, sampled: list[Sequence], launched: LaunchedStep) -> None:
        """Proposals for the next step of every sequence this step gave tokens to (sampled or verified);
        the tokens count towards the speculation switch's measurement."""
        assert self.speculator is not None
        emitted = len(sampled) + sum(len(v.result.token_ids) for _, v in launched.verified)
        seqs = [s for s in sampled if not s.is_finished] + [s for s, _ in launched.verified if not s.is_finished]
        self.speculator.propose(seqs, emitted, read_late=launched.overlapped)

    def _fork_siblings(self, parent: Sequence) -> None:
        for child in parent.pending_forks:
            self.block_manager.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
            self.scheduler.add_running(child)
        parent.pending_forks = []

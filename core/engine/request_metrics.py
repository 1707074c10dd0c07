"""Per-request timings and token counts, taken where the async engine sees each request's life.

:class:`~engine.async_engine.AsyncLLMEngine` calls a :class:`RequestObserver` (when one is set) as a
request is accepted, after every engine step with that step's outputs, and when a request ends without a
final output (aborted, or failed with the engine). :class:`RequestTracker` is the observer that turns
those calls into per-request records and hands them to a :class:`MetricsSink`; the server's Prometheus
metrics are one such sink (``engine.entrypoints.openai.metrics``), and an offline caller can plug in its
own. Nothing here imports a metrics library.

Every call comes from the engine thread, so the tracker's state needs no lock; timestamps are
``time.monotonic()`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.outputs import PoolingRequestOutput, RequestOutput

#: the finish reason of a request aborted by its caller (a client hang-up, a deadline, the server's shutdown)
ABORT = "abort"
#: the finish reason of a request the engine failed while it was in flight
ERROR = "error"


class RequestObserver(Protocol):
    """What the async engine tells about each request; every call comes from the engine thread."""

    def request_added(
        self, request_id: str, arrival: float, num_prompt_tokens: int | None, num_completions: int
    ) -> None:
        """The engine accepted a request.

        Args:
            request_id: the request's id.
            arrival: when the caller handed it to the async engine (monotonic seconds).
            num_prompt_tokens: its prompt's length, when the prompt came as token ids (None: text, to be
                read from its first output).
            num_completions: how many completions it asks for (``n``, or the beam width).
        """

    def step_done(
        self,
        started: float,
        now: float,
        outputs: Sequence[RequestOutput],
        running_ids: Callable[[], set[str] | None],
    ) -> None:
        """An engine step ran.

        Args:
            started: when the step began.
            now: when it returned its outputs.
            outputs: the step's outputs (read at once; the engine may reuse them later).
            running_ids: the ids of the requests the scheduler is running now, computed on demand (None:
                the engine does not say).
        """

    def request_ended(self, request_id: str, now: float, reason: str) -> None:
        """A request ended without a finished output (:data:`ABORT` or :data:`ERROR`); unknown ids are ignored."""


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One request's life, reported once it finished or was aborted.

    Attributes:
        request_id: the request's id.
        arrival: when it reached the async engine.
        scheduled: when the scheduler first ran it (None: never ran).
        first_token: when its first generated token came out (None: none did).
        last_token: when its last generated token came out (None: none did).
        finished: when it ended.
        num_prompt_tokens: its prompt's length (0 for a text prompt aborted before any output).
        num_generation_tokens: tokens generated over all its completions, as of its last output.
        finish_reasons: one per completion (``stop``, ``length``, ``abort``, ``error``, ...).
    """

    request_id: str
    arrival: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reasons: tuple[str, ...]

    @property
    def e2e_time(self) -> float:
        """Seconds from arrival to the end."""
        return self.finished - self.arrival

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival until the scheduler first ran it."""
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def prefill_time(self) -> float | None:
        """Seconds from its first scheduling to its first token."""
        if self.scheduled is None or self.first_token is None:
            return None
        return max(0.0, self.first_token - self.scheduled)

    @property
    def decode_time(self) -> float | None:
        """Seconds from its first token to its last."""
        if self.first_token is None or self.last_token is None:
            return None
        return self.last_token - self.first_token


class MetricsSink(Protocol):
    """Where :class:`RequestTracker` reports (called on the engine thread: keep each call cheap)."""

    def first_token(self, seconds: float) -> None:
        """A request's first token came out, ``seconds`` after its arrival."""

    def inter_token(self, seconds: float) -> None:
        """A request's output brought new tokens ``seconds`` after its previous one did."""

    def finished(self, request: FinishedRequest) -> None:
        """A request finished or was aborted."""


@dataclass(slots=True)
class _Live:
    """What the tracker knows of a request in flight."""

    arrival: float
    num_prompt_tokens: int | None
    num_completions: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    #: the longest completion's length as of the last output, to tell an output that brought tokens
    longest: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)


class RequestTracker:
    """A :class:`RequestObserver` that times each request and reports to a sink.

    Time to first token is reported as it happens, each later output that brings tokens as one
    inter-token latency (one observation per output chunk, which is one token per completion per engine
    step), and the whole record once the request ends.

    A request's first scheduling is the start of the first step after which the scheduler reports it
    running. An engine that does not report what it runs, or a request that was scheduled and finished
    (or was preempted) within one step, falls back to the start of the step that returned its first
    output.

    Args:
        sink: where the observations go.
    """

    def __init__(self, sink: MetricsSink) -> None:
        self.sink = sink
        self._live: dict[str, _Live] = {}
        #: requests not yet seen scheduled: while there are none, nobody asks the engine what runs
        self._unscheduled: set[str] = set()

    @property
    def num_tracked(self) -> int:
        """Requests in flight the tracker is timing."""
        return len(self._live)

    def request_added(
        self, request_id: str, arrival: float, num_prompt_tokens: int | None, num_completions: int
    ) -> None:
        """See :meth:`RequestObserver.request_added`."""
        self._live[request_id] = _Live(arrival, num_prompt_tokens, max(1, num_completions))
        self._unscheduled.add(request_id)

    def step_done(
        self,
        started: float,
        now: float,
        outputs: Sequence[RequestOutput],
        running_ids: Callable[[], set[str] | None],
    ) -> None:
        """See :meth:`RequestObserver.step_done`."""
        if self._unscheduled:
            running = running_ids()
            if running is not None:
                for request_id in self._unscheduled & running:
                    self._live[request_id].scheduled = started
                self._unscheduled -= running
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is not None:
                self._on_output(output.request_id, live, output, started, now)

    def request_ended(self, request_id: str, now: float, reason: str) -> None:
        """See :meth:`RequestObserver.request_ended`."""
        live = self._live.get(request_id)
        if live is None:
            return
        reasons = live.finish_reasons or [None] * live.num_completions
        self._finish(request_id, live, now, tuple(r or reason for r in reasons))

    def _on_output(
        self, request_id: str, live: _Live, output: RequestOutput, started: float, now: float
    ) -> None:
        if live.num_prompt_tokens is None:
            live.num_prompt_tokens = len(output.prompt_token_ids)
        if live.scheduled is None:
            # the scheduler's report missed it: the step that returned its first output ran it by then
            live.scheduled = started
            self._unscheduled.discard(request_id)
        if isinstance(output, PoolingRequestOutput):
            # a pooled prompt: no tokens generated, its one output is its first and last
            live.first_token = live.last_token = now
            self._finish(request_id, live, now, ("stop",))
            return
        completions = output.outputs
        if len(completions) == 1:  # the common case, every step of every request: no lists
            only = completions[0]
            longest = total = len(only.token_ids)
            if only.finish_reason is not None:
                live.finish_reasons = [only.finish_reason]
        else:
            lengths = [len(c.token_ids) for c in completions]
            longest, total = max(lengths, default=0), sum(lengths)
            live.finish_reasons = [c.finish_reason for c in completions]
        if longest > live.longest:
            if live.first_token is None:
                live.first_token = now
                self.sink.first_token(now - live.arrival)
            else:
                assert live.last_token is not None
                self.sink.inter_token(now - live.last_token)
            live.last_token = now
            live.longest = longest
        live.num_tokens = total
        if output.finished:
            self._finish(request_id, live, now, tuple(r or ABORT for r in live.finish_reasons))

    def _finish(self, request_id: str, live: _Live, now: float, reasons: tuple[str, ...]) -> None:
        del self._live[request_id]
        self._unscheduled.discard(request_id)
        self.sink.finished(
            FinishedRequest(
                request_id=request_id,
                arrival=live.arrival,
                scheduled=live.scheduled,
                first_token=live.first_token,
                last_token=live.last_token,
                finished=now,
                num_prompt_tokens=live.num_prompt_tokens or 0,
                num_generation_tokens=live.num_tokens,
                finish_reasons=reasons,
            )
        )


__all__ = ["ABORT", "ERROR", "FinishedRequest", "MetricsSink", "RequestObserver", "RequestTracker"]

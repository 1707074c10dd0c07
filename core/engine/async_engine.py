"""An asyncio front for :class:`~engine.llm_engine.LLMEngine`: one thread steps the engine, coroutines stream.

The engine is not thread-safe, so a single background thread owns it. Coroutines never touch it: they
put commands (add, abort, stop, and :mod:`engine.engine_calls` such as adding a LoRA adapter) on a
thread-safe queue, and the thread hands every step's outputs back to the owning request's stream on
the event loop with ``call_soon_threadsafe``. When there is no work the thread blocks on the queue, so
an idle server uses no CPU.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from engine.engine_calls import EngineCall
from engine.engine_core import EngineCore, RemoteEngineCore
from engine.engine_stats import EngineStats
from engine.engine_thread_messages import (
    _Abort,
    _AbortAll,
    _Add,
    _Command,
    _deliver_all,
    _resolve,
    _Stop,
)
from engine.errors import FatalEngineError
from engine.outputs import RequestOutput
from engine.request_metrics import ABORT, ERROR
from engine.request_stream import EngineDeadError, RequestStream

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.lora.request import LoRARequest
    from engine.request_metrics import RequestObserver
    from engine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """Runs an engine on a background thread and streams its outputs to coroutines.

    Args:
        engine: the synchronous engine; this object owns it from now on.
        observer: told of each request's arrival, outputs and end, on the engine thread (the server's
            metrics, :mod:`engine.request_metrics`); None costs nothing. Set it (or the attribute)
            before the engine starts.
        stream_interval: hand a request's outputs to its stream every this many generated tokens (the
            first and the last always), as SGLang's ``--stream-interval``: outputs are cumulative, so
            nothing is lost, and under load the event loop wakes and writes that many times less.

    Raises:
        ValueError: ``stream_interval`` is below 1.
    """

    def __init__(self, engine: EngineCore, observer: RequestObserver | None = None, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.engine = engine
        self.observer = observer
        self.stream_interval = stream_interval
        #: per request in flight, its generated tokens when its stream was last handed an output
        self._streamed_tokens: dict[str, int] = {}  # touched only by the engine thread
        #: called on the engine thread once the loop has crashed and every request was failed (the
        #: server stops itself, to exit non-zero)
        self.on_dead: Callable[[BaseException], None] | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        #: an engine core in another process: its step waits for that process, and is interrupted when a
        #: command is queued; a request it was sent is accepted or refused with a later step
        self._remote = engine if isinstance(engine, RemoteEngineCore) else None
        #: requests sent to a remote core and not yet settled by it
        self._pending: dict[str, _Add] = {}  # touched only by the engine thread
        self._streams: dict[str, RequestStream] = {}  # touched only by the engine thread
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._shut_down = False
        self._num_requests_total = 0
        self._num_steps = 0
        self._peak_batch = 0
        self._stats = self._take_stats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        """Build the engine (loads the model; takes seconds) and wrap it."""
        from engine.engine_factory import create_engine

        return cls(create_engine(config))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def generation_defaults(self) -> dict[str, float | int]:
        return self.engine.generation_defaults

    @property
    def label_names(self) -> dict[int, str]:
        """A classifier's label names by index (its config's ``id2label``); empty when unknown."""
        if self._remote is not None:
            return self._remote.label_names
        config = getattr(self.engine, "model_config", None)
        raw = config.hf_config.get("id2label") if config is not None else None
        return {int(k): str(v) for k, v in (raw or {}).items()}

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    @property
    def dead(self) -> BaseException | None:
        """What crashed the engine loop, or None while it runs."""
        return self._dead

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort whatever is in flight, stop the thread and wait for it, then stop the engine's workers.

        Args:
            timeout: seconds to wait for the current step to end.
        """
        self._shut_down = True
        if self._thread is not None:
            self._put(_Stop())
            self._thread.join(timeout)
            self._thread = None
        # the tensor-parallel ranks' processes go with the engine
        self.engine.shutdown()

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
        priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted or refused it.

        Args:
            request_id: unique among requests in flight.
            prompt: text, or token ids.
            params: how to sample.
            cache_salt: share cached prefix blocks only with requests of the same salt (None: with every
                unsalted request).
            priority: lower runs first; equal priorities in arrival order.
            lora_request: the LoRA adapter it runs under; None: the base model.

        Returns:
            The request's stream of cumulative outputs.

        Raises:
            engine.errors.InvalidRequestError: the engine refused the request (bad prompt, too long, ...).
            engine.errors.QueueFullError: the waiting queue is full.
            EngineDeadError: the engine is not running.
        """
        self._check_alive()
        self.start()
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop)
        accepted: asyncio.Future[None] = loop.create_future()
        self._put(_Add(request_id, prompt, params, stream, accepted, cache_salt, time.monotonic(), priority, lora_request))
        try:
            await accepted
        except asyncio.CancelledError:
            # The caller went away while the engine was still taking the request: take it back out.
            self.abort(request_id)
            raise
        return stream

    def _put(self, command: _Command) -> None:
        self._commands.put(command)
        if self._remote is not None:
            self._remote.interrupt()  # its thread may be waiting for the core's next step

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        if self._shut_down:
            raise EngineDeadError("the engine is shut down")

    async def run_on_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread, between steps, and return its result.

        Raises:
            Exception: what ``fn`` raised (``InvalidRequestError`` for a refused adapter).
            EngineDeadError: the engine is not running.
        """
        self._check_alive()
        self.start()
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._put(EngineCall(fn, done))
        return await done

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """``LLMEngine.add_lora`` on the engine thread: False when already registered; raises
        ``InvalidRequestError`` for an adapter that cannot be used."""
        return bool(await self.run_on_engine(lambda engine: engine.add_lora(lora_request)))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """``LLMEngine.remove_lora`` on the engine thread: False when unknown; raises
        ``InvalidRequestError`` while requests run under it."""
        return bool(await self.run_on_engine(lambda engine: engine.remove_lora(lora_int_id)))

    async def list_loras(self) -> list[LoRARequest]:
        """The engine's registered adapters."""
        return list(await self.run_on_engine(lambda engine: engine.list_loras()))

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request at its next iteration; unknown ids are ignored."""
        self._put(_Abort(request_id))

    def abort_all(self) -> None:
        """Abort every request in flight at the engine's next iteration; their streams end as aborted.

        The server calls this when its shutdown grace period is over, so that each open response can
        still be ended properly (``finish_reason: "abort"``) before the connections close.
        """
        self._put(_AbortAll())

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative outputs; aborts it if the consumer stops early."""
        stream = await self.add_request(request_id, prompt, params, cache_salt, lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    def stats(self) -> EngineStats:
        """The latest snapshot from the engine thread."""
        return self._stats

    # ---- everything below runs on the engine thread ----

    def _take_stats(self) -> EngineStats:
        return EngineStats(
            num_free_blocks=int(self.engine.num_free_blocks),
            num_total_blocks=int(self.engine.num_total_blocks),
            num_requests_in_flight=len(self._streams),
            num_requests_total=self._num_requests_total,
            num_steps=self._num_steps,
            peak_batch_size=self._peak_batch,
            scheduler=dict(self.engine.stats()) if hasattr(self.engine, "stats") else {},
        )

    def _run(self) -> None:
        try:
            while True:
                has_work = self.engine.has_unfinished_requests()
                commands = self._next_commands(block=not has_work)
                if any(isinstance(c, _Stop) for c in commands):
                    for c in commands:
                        if isinstance(c, _Add):
                            self._refuse(c, EngineDeadError("the server is shutting down"))
                        elif isinstance(c, EngineCall):
                            c.settle(None, EngineDeadError("the server is shutting down"))
                    self._abort_all(None, aborted=True)
                    return
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._stats = self._take_stats()
        except BaseException as exc:  # the thread must never die silently with requests waiting on it
            logger.exception("engine loop crashed")
            self._dead = exc
            self._abort_all(EngineDeadError(f"the engine loop crashed: {type(exc).__name__}: {exc}"), aborted=False)
            if self.on_dead is not None:
                self.on_dead(exc)
            raise
        finally:
            self._stats = self._take_stats()

    def _next_commands(self, block: bool) -> list[_Command]:
        commands: list[_Command] = []
        if block:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add):
            # the salt travels only when given, so engines without prefix-cache salts still serve the rest
            extra: dict[str, Any] = {} if command.cache_salt is None else {"cache_salt": command.cache_salt}
            if command.priority:
                extra["priority"] = command.priority
            if command.lora_request is not None:
                extra["lora_request"] = command.lora_request
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params, **extra)
            except Exception as exc:  # refusals travel back to the caller, who decides the HTTP status
                self._refuse(command, exc)
                return
            self._streams[command.request_id] = command.stream
            if self._remote is not None:
                self._pending[command.request_id] = command  # accepted or refused with a later step
            else:
                self._accepted(command)
        elif isinstance(command, _Abort):
            self._settle_pending(command.request_id)
            stream = self._streams.pop(command.request_id, None)
            self._streamed_tokens.pop(command.request_id, None)
            self.engine.abort_request(command.request_id)
            if stream is not None:
                self._call_on_loop(stream, stream._finish, True, None)
                if self.observer is not None:
                    self._observe(self.observer.request_ended, command.request_id, time.monotonic(), ABORT)
        elif isinstance(command, _AbortAll):
            self._abort_all(None, aborted=True)
        elif isinstance(command, EngineCall):
            command.run(self.engine)

    def _accepted(self, command: _Add) -> None:
        self._num_requests_total += 1
        if self.observer is not None:
            num_prompt = len(command.prompt) if isinstance(command.prompt, list) else None
            width = getattr(command.params, "n", None) or getattr(command.params, "beam_width", 1)
            self._observe(self.observer.request_added, command.request_id, command.arrival, num_prompt, width)
        self._call_on_loop(command.stream, _resolve, command.accepted, None)

    def _refuse(self, command: _Add, exc: BaseException) -> None:
        self._call_on_loop(command.stream, _resolve, command.accepted, exc)

    def _settle_pending(self, request_id: str) -> None:
        """A request the remote core has not settled yet is aborted: its caller gets its stream, which
        ends aborted (as an accepted request's would)."""
        command = self._pending.pop(request_id, None)
        if command is not None:
            self._call_on_loop(command.stream, _resolve, command.accepted, None)

    def _take_settled(self) -> None:
        assert self._remote is not None
        for request_id, error in self._remote.settled_requests():
            command = self._pending.pop(request_id, None)
            if command is None:
                continue  # aborted before the core took it
            if error is None:
                self._accepted(command)
            else:
                del self._streams[request_id]
                self._refuse(command, error)

    def _step(self) -> None:
        started = time.monotonic() if self.observer is not None else 0.0
        try:
            outputs = self.engine.step()
            if self._remote is not None:
                self._take_settled()
        except FatalEngineError:
            raise  # the loop's crash handler fails every request and reports the engine dead
        except Exception as exc:  # an engine bug: fail the requests in flight, keep serving new ones
            logger.exception("engine step failed; aborting %d request(s)", len(self._streams))
            self._abort_all(EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"), aborted=False)
            return
        if self._remote is not None and not self._remote.steps_read:
            return  # woken for a command before the core's next step came: no step to count
        self._num_steps += 1
        self._peak_batch = max(self._peak_batch, len(outputs))
        if self.observer is not None:
            self._observe(self.observer.step_done, started, time.monotonic(), outputs, self._running_ids)
        # One hand-over per event loop per step, not one per request: each call_soon_threadsafe wakes
        # the loop with a syscall and makes the two threads trade the GIL, which at a few hundred
        # streams cost the engine thread milliseconds a step.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                self._streamed_tokens.pop(output.request_id, None)
            elif self.stream_interval > 1 and not self._due(output):
                continue
            batches.setdefault(stream._loop, []).append((stream, output))
        for deliveries in batches.values():
            self._call_on_loop(deliveries[0][0], _deliver_all, deliveries)

    def _due(self, output: RequestOutput) -> bool:
        """Whether an unfinished output goes to its stream now (``stream_interval``): its first tokens,
        then once ``stream_interval`` more have come. (A pooling output is always finished: it never
        gets here.)"""
        completions = output.outputs
        if not completions:
            return True
        generated = max(len(c.token_ids) for c in completions)
        last = self._streamed_tokens.get(output.request_id)
        if last is not None and generated - last < self.stream_interval:
            return False
        self._streamed_tokens[output.request_id] = generated
        return True

    def _abort_all(self, error: BaseException | None, aborted: bool) -> None:
        for request_id in list(self._pending):
            self._settle_pending(request_id)
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # already failing; the stream still has to be released below
                logger.exception("aborting %s failed", request_id)
            self._call_on_loop(stream, stream._finish, aborted, error)
            if self.observer is not None:
                self._observe(self.observer.request_ended, request_id, time.monotonic(), ABORT if aborted else ERROR)
        self._streams.clear()
        self._streamed_tokens.clear()

    def _running_ids(self) -> set[str] | None:
        # LLMEngine's scheduler lists the sequences it runs, an engine core in its own process reports
        # them; other engines (data-parallel replicas, test fakes) do not say, and the observer falls back
        # to their first output
        if self._remote is not None:
            return self._remote.running_ids()
        running = getattr(getattr(self.engine, "scheduler", None), "running", None)
        if not isinstance(running, list):
            return None
        return {seq.request_id for seq in running}

    def _observe(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            # a metrics bug must not take the engine down with it: serving goes on without the observer
            logger.exception("the request observer failed; it is switched off")
            self.observer = None

    @staticmethod
    def _call_on_loop(stream: RequestStream, fn: Any, *args: Any) -> None:
        try:
            stream._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            # The event loop is closed (process exiting): nobody is left to tell.
            logger.debug("event loop closed; dropping an update for %s", stream.request_id)


__all__ = ["AsyncLLMEngine", "EngineCore", "EngineDeadError", "EngineStats", "RequestStream"]

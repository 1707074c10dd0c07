"""The server's handle on an engine core running in its own process (``engine serve --engine-core-process``).

:class:`EngineCoreClient` stands where :class:`~engine.llm_engine.LLMEngine` stands for
:class:`~engine.async_engine.AsyncLLMEngine` (it satisfies :class:`~engine.engine_core.RemoteEngineCore`),
but the work happens in :mod:`engine.engine_core_process`: adding a request only sends it, and whether the
core took or refused it comes back with the core's next step (:meth:`settled_requests`); :meth:`step`
waits for the core's next pushed step, or for :meth:`interrupt`, without holding the interpreter lock.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import weakref
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.engine_core_process import CORE_NAME, CoreStep, EngineCoreInfo
from engine.errors import InvalidRequestError
from engine.input_processor import InputProcessor
from engine.output_deltas import OutputDeltaDecoder
from engine.parallel.mp_workers import LOAD_TIMEOUT_S, WorkerFailed, exit_reason, stop_processes
from engine.parallel.replica import rebuild_error

if TYPE_CHECKING:
    from engine.lora.request import LoRARequest
    from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineCoreClient:
    """Requests in, outputs out, over a pipe to the engine core's process.

    Not thread-safe, like ``LLMEngine`` (one thread adds, aborts, steps and calls), except
    :meth:`interrupt`, which any thread may call.

    Args:
        process: the engine core's process, ready.
        pipe: this side of its pipe.
        info: what the core said once built.
        tokenizer: the model's tokenizer, loaded in this process for the server's own use (chat
            templates, logprob tokens' text).
    """

    def __init__(self, process: Any, pipe: Connection, info: EngineCoreInfo, tokenizer: Any) -> None:
        self.process = process
        self.pipe = pipe
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.model_name = info.model_name
        self.model_path = info.model_path
        self.generation_defaults = info.generation_defaults
        self.label_names = info.label_names
        self._num_total_blocks = info.num_total_blocks
        self._num_free_blocks = info.num_total_blocks
        self._stats: dict[str, int | float] = dict(info.stats)
        self._decoder = OutputDeltaDecoder()
        self._inputs = InputProcessor(tokenizer, info.vocab_size, info.max_model_len)
        #: requests sent and neither finished, refused nor aborted
        self._in_flight: set[str] = set()
        #: ``add`` and ``abort`` messages sent that no ``CoreStep`` has counted yet: while there are any, the
        #: core has news (a refusal, its counters after an abort), so :meth:`has_unfinished_requests` holds
        self._unacknowledged = 0
        #: core steps read while waiting for a call's answer, for the next :meth:`step`
        self._buffered: list[CoreStep] = []
        self._settled: list[tuple[str, Exception | None]] = []
        #: requests in flight that the core's scheduler has run (None: the core does not say)
        self._running: set[str] | None = set()
        #: how many of the core's steps the last :meth:`step` read (0: it was interrupted first)
        self.steps_read = 0
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._finalizer = weakref.finalize(self, _close, process, pipe, self._wake_read, self._wake_write)

    @classmethod
    def start(cls, config: EngineConfig, plugin_files: tuple[str, ...] = ()) -> EngineCoreClient:
        """Start the engine core's process and wait until it has built its engine.

        Args:
            config: the engine's configuration.
            plugin_files: parser plugin files this process loaded (``--tool-parser-plugin``,
                ``--reasoning-parser-plugin``): the core imports them too, for what requests carry from them.

        Raises:
            WorkerFailed: the core failed to build its engine (its one-line reason) or exited.
        """
        from concurrent.futures import ThreadPoolExecutor

        from engine.engine_core_process import run_engine_core
        from engine.loader import load_tokenizer
        from engine.loader.paths import resolve_model_path

        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=run_engine_core, name="engine-core",
            args=(config.to_process_json(), child, _logging_setup(), tuple(os.path.abspath(p) for p in plugin_files)),
        )
        process.start()
        child.close()
        # this process's tokenizer loads while the core builds its engine (seconds saved at start-up); a
        # model the core cannot load is reported as the core says, before any error of this load
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load") as pool:
            tokenizer_load = pool.submit(lambda: load_tokenizer(config.tokenizer or resolve_model_path(config.model)))
            try:
                if not parent.poll(LOAD_TIMEOUT_S):
                    raise WorkerFailed(f"the engine core did not load within {LOAD_TIMEOUT_S:.0f} s")
                try:
                    kind, payload = _receive(parent, process)
                except WorkerFailed as exc:
                    # a model or configuration the core cannot load reads as it would in this process
                    raise WorkerFailed(str(exc).removeprefix(f"{CORE_NAME}: ")) from None
                if kind != "ready":
                    raise WorkerFailed(f"the engine core said {kind!r} before it was ready")
                tokenizer = tokenizer_load.result()
            except BaseException:
                stop_processes([process], [parent], [])
                raise
        logger.info("engine core running in process %d", process.pid)
        return cls(process, parent, payload, tokenizer)

    def shutdown(self) -> None:
        """Stop the core's process (and whatever it started) and wait for it; safe to call twice."""
        self._finalizer()

    # --- the EngineCore protocol -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self._num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self._num_total_blocks

    def stats(self) -> dict[str, int | float]:
        """The core's counters after its latest step."""
        return self._stats

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight or self._buffered or self._unacknowledged)

    def add_request(self, request_id: str, prompt: str | list[int], params: Any, **options: Any) -> None:
        """Send a request to the core; its acceptance or refusal comes later from :meth:`settled_requests`.

        A text prompt is tokenized here and travels with its ids, which the core checks without encoding
        the text again: a burst of arrivals (hundreds of prompts at about a millisecond each) then does
        not hold back the core's steps.

        Raises:
            InvalidRequestError: ``request_id`` is in flight already (refused here, so that the request
                using it goes on), an empty text prompt, or one too long for the context before tokenizing.
            WorkerFailed: the core's process is gone.
        """
        if request_id in self._in_flight:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str) and options.get("prompt_token_ids") is None:
            options["prompt_token_ids"] = self._inputs.tokenize(prompt)
        self._send("add", (request_id, prompt, params, options))
        self._in_flight.add(request_id)
        self._unacknowledged += 1

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests in the core; their outputs still on the way are dropped. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self._in_flight.discard(rid)
            self._decoder.forget(rid)
            if self._running is not None:
                self._running.discard(rid)
        self._send("abort", ids)
        self._unacknowledged += 1

    def settled_requests(self) -> list[tuple[str, Exception | None]]:
        """Requests the core took (None) or refused (the error) since the last call, in the order sent."""
        settled, self._settled = self._settled, []
        return settled

    def running_ids(self) -> set[str] | None:
        """Requests in flight that the core has scheduled (for the metrics' queue time), or None when the
        core does not say."""
        return self._running

    def interrupt(self) -> None:
        """Make a :meth:`step` that waits return now (with what it has), from any thread."""
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:
            pass  # a wake-up is already pending: one is enough

    def step(self) -> list[RequestOutput]:
        """The outputs of the core's steps that arrived since the last call, waiting for one if none has
        (or until :meth:`interrupt`).

        Raises:
            RuntimeError: a step of the core failed (its message); the core goes on.
            WorkerFailed: the core's process failed or exited; it cannot go on.
        """
        if not self._buffered:
            ready = wait([self.pipe, self._wake_read])
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
        while self.pipe.poll():
            self._buffer(*_receive(self.pipe, self.process))
        steps, self._buffered = self._buffered, []
        self.steps_read = len(steps)
        outputs: list[Any] = []
        failures: list[str] = []
        decode, in_flight = self._decoder.decode, self._in_flight
        for core_step in steps:
            self._unacknowledged -= core_step.applied
            for request_id, error in core_step.settled:
                if error is not None:
                    in_flight.discard(request_id)
                self._settled.append((request_id, rebuild_error(error) if error is not None else None))
            if core_step.failed is not None:
                failures.append(core_step.failed)
            if core_step.scheduled is None:
                self._running = None
            elif self._running is not None:
                self._running.update(core_step.scheduled)
            for delta in core_step.outputs:
                if delta.request_id not in in_flight:
                    continue  # aborted after the core sent it
                output = decode(delta)
                if output.finished:
                    in_flight.discard(output.request_id)
                    if self._running is not None:
                        self._running.discard(output.request_id)
                outputs.append(output)
            self._num_free_blocks = core_step.num_free_blocks
            self._stats = core_step.stats
        if failures:
            raise RuntimeError("; ".join(failures))
        return outputs

    # --- adapters (``AsyncLLMEngine.run_on_engine`` calls these on its engine thread) ----------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """``LLMEngine.add_lora`` in the core."""
        return bool(self._call("add_lora", lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        """``LLMEngine.remove_lora`` in the core."""
        return bool(self._call("remove_lora", lora_id))

    def list_loras(self) -> list[LoRARequest]:
        """``LLMEngine.list_loras`` in the core."""
        return list(self._call("list_loras"))

    # --- the pipe ----------------------------------------------------------------------------------

    def _call(self, name: str, *args: Any) -> Any:
        self._send("call", (name, args))
        while True:
            kind, payload = _receive(self.pipe, self.process)
            if kind == "answer":
                ok, result = payload
                if not ok:
                    raise rebuild_error(result)
                return result
            self._buffer(kind, payload)

    def _buffer(self, kind: str, payload: Any) -> None:
        if kind != "step":
            raise WorkerFailed(f"the engine core said {kind!r} unasked")
        self._buffered.append(payload)

    def _send(self, kind: str, payload: Any) -> None:
        try:
            self.pipe.send((kind, payload))
        except (BrokenPipeError, EOFError, OSError):
            raise WorkerFailed(exit_reason(self.process, "the engine core process")) from None


def _logging_setup() -> tuple[int, str | None] | None:
    """This process's root log level and format, when it configured logging (``engine serve`` does)."""
    root = logging.getLogger()
    if not root.handlers:
        return None
    formatter = root.handlers[0].formatter
    return root.level, getattr(formatter, "_fmt", None)


def _receive(pipe: Connection, process: Any) -> tuple[str, Any]:
    try:
        kind, payload = pipe.recv()
    except (EOFError, OSError):
        raise WorkerFailed(exit_reason(process, "the engine core process")) from None
    if kind == "error":
        raise WorkerFailed(payload)
    return kind, payload


def _close(process: Any, pipe: Connection, wake_read: int, wake_write: int) -> None:
    stop_processes([process], [pipe], [])
    os.close(wake_read)
    os.close(wake_write)


__all__ = ["EngineCoreClient"]

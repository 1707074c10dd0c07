"""The engine core in a process of its own: it steps whenever it has work and pushes its outputs back.

``engine serve --engine-core-process`` runs the scheduler, the model and the output processing here, and
keeps only HTTP, streaming and the request bookkeeping in the server's process
(:class:`~engine.engine_core_client.EngineCoreClient`), so that the two never take turns at one
interpreter lock: under load the server's event loop (a JSON chunk per token per stream) otherwise holds
it for a fifth of the time, and each of the engine's steps waits for it.

Nothing here waits for the server: requests arrive fire-and-forget and are answered with the step that
took them. Messages on the pipe are ``(kind, payload)``:

- in: ``("add", (request_id, prompt, params, options))``, ``("abort", request_ids)``,
  ``("call", (name, args))`` (``add_lora``, ``remove_lora``, ``list_loras``), ``("stop", None)``;
- out: ``("ready", EngineCoreInfo)`` once the engine is built (or ``("error", reason)``, and the process
  exits); then after each iteration that did something ``("step", CoreStep)``; for each call
  ``("answer", (ok, result or portable error))``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from engine.errors import FatalEngineError
from engine.output_deltas import OutputDeltaEncoder
from engine.parallel.replica import portable_error

logger = logging.getLogger(__name__)

#: who the core's failures name (``exit_with_failure``'s ``who``)
CORE_NAME = "engine core"

#: the engine methods a ``("call", (name, args))`` message may run
CALLS = ("add_lora", "remove_lora", "list_loras")


@dataclass(slots=True)
class EngineCoreInfo:
    """What the server learns from the engine core once it is built."""

    max_model_len: int
    model_name: str
    model_path: str
    num_total_blocks: int
    vocab_size: int
    generation_defaults: dict[str, float | int]
    #: a classifier's label names by index (its config's ``id2label``); empty when unknown
    label_names: dict[int, str]
    #: the engine's counters before any request (the server's metrics read them from the start)
    stats: dict[str, int | float] = field(default_factory=dict)


@dataclass(slots=True)
class CoreStep:
    """One iteration of the engine core.

    Attributes:
        applied: how many ``add`` and ``abort`` messages the core applied since its last ``CoreStep`` (the
            server counts what it sent and waits for the count, so that its counters are fresh after an
            abort that left the core idle).
        settled: per request added since the last message, its id and None (queued) or the portable
            error that refused it, in the order they arrived.
        outputs: the step's outputs as :class:`~engine.output_deltas.OutputDelta` (pooling outputs whole).
        failed: the step raised (its message): the requests in flight are to be failed; the core goes on.
        scheduled: requests the scheduler ran for the first time in this step, for the server's queue-time
            metrics (None: the engine does not say, as the data-parallel front does not).
        num_free_blocks: KV blocks free after the step.
        stats: the engine's counters after the step.
    """

    applied: int
    settled: list[tuple[str, tuple[str, str, dict[str, Any]] | None]]
    outputs: list[Any]
    failed: str | None
    scheduled: list[str] | None
    num_free_blocks: int
    stats: dict[str, int | float] = field(default_factory=dict)


def run_engine_core(
    config_json: str, pipe: Connection, logging_setup: tuple[int, str | None] | None = None,
    plugin_files: tuple[str, ...] = (),
) -> None:
    """The process entry (see the module docstring).

    Args:
        plugin_files: the server's parser plugin files, imported here under the same module names, so that
            what a request carries from them (a reasoning parser's end test) unpickles here.
        logging_setup: the server's root log level and format, so that the core's log lines (load times,
            warnings) read as they would in the server's process; None leaves logging unconfigured.
    """
    import signal

    # the server owns the lifecycle: a Ctrl-C or a SIGTERM sent to the whole process group (a terminal, a
    # service manager) lets it drain its requests, then it stops this process over the pipe; were this
    # process gone first, every request in flight would fail
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if logging_setup is not None:
        level, fmt = logging_setup
        logging.basicConfig(level=level, format=fmt)
    from engine.config import EngineConfig
    from engine.engine_factory import create_engine
    from engine.named_registry import import_plugin_file
    from engine.parallel.worker import exit_with_failure

    engine = None
    try:
        for path in plugin_files:
            import_plugin_file(path)
        config = EngineConfig.model_validate_json(config_json)
        engine = create_engine(config)
        model_config = getattr(engine, "model_config", None)
        raw = model_config.hf_config.get("id2label") if model_config is not None else None
        pipe.send(("ready", EngineCoreInfo(
            max_model_len=engine.max_model_len,
            model_name=engine.model_name,
            model_path=engine.model_path,
            num_total_blocks=engine.num_total_blocks,
            vocab_size=engine.model_config.vocab_size if model_config is not None else 0,
            generation_defaults=dict(engine.generation_defaults),
            label_names={int(k): str(v) for k, v in (raw or {}).items()},
            stats=dict(engine.stats()),
        )))  # fmt: skip
        EngineCoreLoop(engine, pipe).run()
    except (EOFError, BrokenPipeError):
        return  # the server is gone: so is this process's reason to run
    except BaseException as exc:
        exit_with_failure(pipe, CORE_NAME, exc)
    finally:
        if engine is not None:
            engine.shutdown()


class EngineCoreLoop:
    """Takes the server's messages between steps and steps while there is work.

    Args:
        engine: the synchronous engine (``LLMEngine``, or the data-parallel front).
        pipe: this process's end of the pipe to the server.
    """

    def __init__(self, engine: Any, pipe: Connection) -> None:
        self.engine = engine
        self.pipe = pipe
        self.encoder = OutputDeltaEncoder()
        #: requests in flight that the scheduler has run (reported once, in :attr:`CoreStep.scheduled`)
        self._scheduled: set[str] = set()
        #: requests taken and not yet finished or aborted
        self._live: set[str] = set()

    def run(self) -> None:
        """Serve until ``("stop", None)`` or until the server's end of the pipe closes (``EOFError``).

        Raises:
            FatalEngineError: the engine cannot go on (a rank of it is gone); the caller reports it.
        """
        engine, pipe = self.engine, self.pipe
        while True:
            settled: list[tuple[str, Any]] = []
            applied = 0
            # block only when idle: with work, take what arrived during the last step and step again
            message = pipe.recv() if not engine.has_unfinished_requests() else None
            while True:
                if message is not None:
                    if message[0] == "stop":
                        return
                    applied += self._apply(message, settled)
                if not pipe.poll():
                    break
                message = pipe.recv()
            outputs: list[Any] = []
            failed = None
            scheduled: list[str] | None = []
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except FatalEngineError:
                    raise  # a rank or replica of this engine is gone: so is the engine
                except Exception as exc:  # as in one process: the requests in flight fail, serving goes on
                    logger.exception("engine step failed; aborting %d request(s)", len(self._live))
                    failed = f"{type(exc).__name__}: {exc}"
                    # the server fails them too; aborted here, they are not stepped (and fail) again meanwhile
                    self._abort(list(self._live))
                for out in outputs:
                    if out.finished:
                        self._live.discard(out.request_id)
                        self._scheduled.discard(out.request_id)
                scheduled = self._newly_scheduled()
            if applied or outputs or scheduled or failed is not None:
                pipe.send(("step", CoreStep(
                    applied, settled, [self.encoder.encode(o) for o in outputs], failed, scheduled,
                    engine.num_free_blocks, dict(engine.stats()),
                )))  # fmt: skip

    def _newly_scheduled(self) -> list[str] | None:
        running = getattr(getattr(self.engine, "scheduler", None), "running", None)
        if not isinstance(running, list):
            return None
        new = {seq.request_id for seq in running}
        new.difference_update(self._scheduled)
        self._scheduled.update(new)
        return list(new)

    def _abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        self.encoder.forget(request_ids)
        self._scheduled.difference_update(request_ids)
        self._live.difference_update(request_ids)

    def _apply(self, message: tuple[str, Any], settled: list[tuple[str, Any]]) -> int:
        """Apply one message other than ``stop``; 1 for an ``add`` or ``abort`` (what ``CoreStep.applied``
        counts), else 0."""
        kind, payload = message
        if kind == "add":
            request_id, prompt, params, options = payload
            try:
                self.engine.add_request(request_id, prompt, params, **options)
            except Exception as exc:  # a refusal travels back to the caller, who decides the HTTP status
                settled.append((request_id, portable_error(exc)))
            else:
                settled.append((request_id, None))
                self._live.add(request_id)
        elif kind == "abort":
            self._abort(payload)
        elif kind == "call":
            name, args = payload
            if name not in CALLS:
                self.pipe.send(("answer", (False, portable_error(ValueError(f"unknown engine call {name!r}")))))
                return 0
            try:
                result = getattr(self.engine, name)(*args)
            except Exception as exc:  # the caller's to handle (a refused adapter), not the core's end
                self.pipe.send(("answer", (False, portable_error(exc))))
            else:
                self.pipe.send(("answer", (True, result)))
            return 0
        else:
            raise ValueError(f"the engine core got an unknown message {kind!r}")
        return 1


__all__ = ["CALLS", "CoreStep", "EngineCoreInfo", "EngineCoreLoop", "run_engine_core"]

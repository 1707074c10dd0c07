"""A data-parallel replica's process: a whole engine (scheduler, KV cache, model, its own tensor- or
pipeline-parallel ranks if any) that the driver feeds requests and steps over a pipe.

Requests and steps arrive as ``(kind, payload)`` messages; each is answered in order except ``abort``:

- ``("add", (request_id, prompt, params, options))`` -> ``("added", None)`` or ``("refused", error)``
- ``("validate", (prompt, params, cache_salt))`` -> ``("validated", token_ids)`` or ``("refused", error)``
- ``("step", None)`` -> ``("stepped", StepReply)`` or ``("failed", reason)`` (the step raised; the replica
  goes on, as a single engine does)
- ``("abort", request_ids)``; ``("stop", None)`` ends the process.

Before any of these it answers ``("ready", ReplicaInfo)`` once the engine is built, or ``("error", reason)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from engine.errors import ContextLengthError, InvalidRequestError, QueueFullError
from engine.outputs import RequestOutput

#: the errors a refused request may carry across the pipe, by name
_PORTABLE_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (InvalidRequestError, ContextLengthError, QueueFullError, ValueError)
}


@dataclass(slots=True)
class ReplicaInfo:
    """What the driver learns from a replica once its engine is built."""

    max_model_len: int
    model_name: str
    model_path: str
    vocab_size: int
    block_size: int
    num_total_blocks: int
    generation_defaults: dict[str, float | int]


@dataclass(slots=True)
class StepReply:
    """One step of a replica: its outputs, whether it has work left, and its counters afterwards."""

    outputs: list[RequestOutput]
    has_unfinished: bool
    num_free_blocks: int
    stats: dict[str, int | float] = field(default_factory=dict)


def portable_error(exc: Exception) -> tuple[str, str, dict[str, Any]]:
    """An engine error as plain data (its class name, message and attributes): exceptions whose
    ``__init__`` takes more than the message do not survive pickling as they are."""
    name = type(exc).__name__ if type(exc).__name__ in _PORTABLE_ERRORS else "ValueError"
    return name, str(exc), dict(vars(exc))


def rebuild_error(data: tuple[str, str, dict[str, Any]]) -> Exception:
    """The exception :func:`portable_error` described, of the same class with the same attributes."""
    name, message, attributes = data
    cls = _PORTABLE_ERRORS.get(name, ValueError)
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(attributes)
    return error


def run_replica(config_json: str, index: int, num_replicas: int, pipe: Connection) -> None:
    """The process entry of replica ``index`` of ``num_replicas`` (see the module docstring)."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.parallel.worker import exit_with_failure

    engine = None
    try:
        config = EngineConfig.model_validate_json(config_json)
        # the replicas share the host's cores: each takes its part of the intra-op threads
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_replicas))
        engine = LLMEngine.from_config(config)
        pipe.send(("ready", ReplicaInfo(
            max_model_len=engine.max_model_len,
            model_name=engine.model_name,
            model_path=engine.model_path,
            vocab_size=engine.model_config.vocab_size,
            block_size=engine.config.cache.block_size,
            num_total_blocks=engine.num_total_blocks,
            generation_defaults=dict(engine.generation_defaults),
        )))  # fmt: skip
        _serve(engine, pipe)
    except EOFError:
        return  # the driver is gone: so is this replica's reason to run
    except BaseException as exc:
        exit_with_failure(pipe, f"data-parallel replica {index}", exc)
    finally:
        if engine is not None:
            engine.shutdown()


def _serve(engine: Any, pipe: Connection) -> None:
    while True:
        kind, payload = pipe.recv()
        if kind == "step":
            try:
                outputs = engine.step()
            except (InvalidRequestError, QueueFullError, RuntimeError, ValueError) as exc:
                if getattr(engine, "workers", None) is not None and engine.workers.failure(0.0) is not None:
                    raise  # a rank of this replica is gone: the replica is too
                pipe.send(("failed", str(exc) or type(exc).__name__))
                continue
            pipe.send(("stepped", StepReply(
                outputs, engine.has_unfinished_requests(), engine.num_free_blocks, dict(engine.stats())
            )))  # fmt: skip
        elif kind == "add":
            request_id, prompt, params, options = payload
            try:
                engine.add_request(request_id, prompt, params, **options)
            except (InvalidRequestError, QueueFullError, ValueError) as exc:
                pipe.send(("refused", portable_error(exc)))
            else:
                pipe.send(("added", None))
        elif kind == "validate":
            prompt, params, cache_salt = payload
            try:
                token_ids = engine.validate_request(prompt, params, cache_salt)
            except (InvalidRequestError, ValueError) as exc:
                pipe.send(("refused", portable_error(exc)))
            else:
                pipe.send(("validated", token_ids))
        elif kind == "abort":
            engine.abort_request(payload)
        else:
            return

"""What :class:`~engine.async_engine.AsyncLLMEngine` needs from the synchronous engine it drives.

:class:`~engine.llm_engine.LLMEngine` satisfies :class:`EngineCore`; so do the data-parallel front and
the test fakes, which is why the async front is written against this protocol and not the class. An
engine core in a process of its own satisfies :class:`RemoteEngineCore`, whose requests are accepted
later, with a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from engine.lora.request import LoRARequest
    from engine.outputs import RequestOutput
    from engine.sampling.params import SamplingParams


class EngineCore(Protocol):
    """What the async front needs from the synchronous engine (``LLMEngine`` satisfies it)."""

    tokenizer: Any
    max_model_len: int
    model_name: str
    #: the checkpoint's sampling defaults for fields a request leaves unset (``LLMEngine``'s)
    generation_defaults: dict[str, float | int]

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, *, cache_salt: str | None = None,
        priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; ``cache_salt``, ``priority`` and ``lora_request`` are passed only when given."""

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]:
        """The outputs of the requests the step moved on, as new objects the caller owns: the engine never
        changes them afterwards (the async front hands them to the event loop without copying)."""

    def has_unfinished_requests(self) -> bool: ...

    def shutdown(self) -> None:
        """Stop what the engine started besides this thread (its tensor-parallel workers)."""

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_total_blocks(self) -> int: ...


@runtime_checkable
class RemoteEngineCore(EngineCore, Protocol):
    """An engine core that runs elsewhere (:class:`~engine.engine_core_client.EngineCoreClient`): its
    ``add_request`` only sends the request, and ``step`` waits for whatever the core pushes next."""

    #: a classifier's label names by index; empty when unknown
    label_names: dict[int, str]

    def settled_requests(self) -> list[tuple[str, Exception | None]]:
        """The requests the core took (None) or refused (the error) since the last call, in the order
        they were added; read after each ``step``."""

    #: how many of the core's steps the last ``step`` read (0: it returned early, interrupted)
    steps_read: int

    def running_ids(self) -> set[str] | None:
        """The requests in flight that the core has scheduled, or None when it does not say."""

    def interrupt(self) -> None:
        """Make a waiting ``step`` return now (called from any thread when a command is queued)."""


__all__ = ["EngineCore", "RemoteEngineCore"]

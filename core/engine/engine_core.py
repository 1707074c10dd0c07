"""What :class:`~engine.async_engine.AsyncLLMEngine` needs from the synchronous engine it drives.

:class:`~engine.llm_engine.LLMEngine` satisfies :class:`EngineCore`; so do the data-parallel front and
the test fakes, which is why the async front is written against this protocol and not the class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

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


__all__ = ["EngineCore"]

"""What :class:`~engine.async_engine.AsyncLLMEngine` reports about itself: :class:`EngineStats`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot taken by the engine thread after each of its iterations.

    Attributes:
        num_free_blocks: KV blocks not held by any request.
        num_total_blocks: KV blocks in the cache.
        num_requests_in_flight: requests added and not yet finished or aborted.
        num_requests_total: requests accepted since start.
        num_steps: engine steps run since start.
        peak_batch_size: the most requests that got tokens in one step (continuous batching at work).
        scheduler: the engine's scheduler counters (running, waiting and swapped sequences, KV usage,
            prefix-cache hit rate, preemptions), when the engine reports them.
    """

    num_free_blocks: int
    num_total_blocks: int
    num_requests_in_flight: int
    num_requests_total: int
    num_steps: int
    peak_batch_size: int
    scheduler: dict[str, Any] = field(default_factory=dict)


__all__ = ["EngineStats"]

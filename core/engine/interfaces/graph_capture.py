"""The graph-capture contract: record a step once per batch-size bucket, replay it later."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any


class GraphCapture(ABC):
    """Captures a step function per batch-size bucket and replays it.

    The documented fallback is eager execution: :meth:`run` for a batch size with no captured graph
    simply calls the function. Replay must give the same result as eager for the same inputs, including
    after the inputs change between replays (captures must read their inputs, not a stale copy).
    """

    @abstractmethod
    def capture(self, fn: Callable[..., Any], batch_sizes: list[int], make_inputs: Callable[[int], tuple]) -> None:
        """Record ``fn`` for each bucket.

        Args:
            fn: the step, called as ``fn(*inputs)``.
            batch_sizes: the buckets to capture.
            make_inputs: builds example inputs for a bucket (static buffers a backend may keep).
        """

    @abstractmethod
    def run(self, batch_size: int, *inputs: Any) -> Any:
        """Run the step for ``batch_size`` rows: replay its graph if captured, else run eagerly."""

    def captured_batch_sizes(self) -> list[int]:
        """The buckets that replay a graph; empty for eager-only backends."""
        return []


class EagerGraphCapture(GraphCapture):
    """No capture: every run is eager. Backends without graphs use this."""

    def __init__(self) -> None:
        self._fn: Callable[..., Any] | None = None

    def capture(self, fn: Callable[..., Any], batch_sizes: list[int], make_inputs: Callable[[int], tuple]) -> None:
        self._fn = fn

    def run(self, batch_size: int, *inputs: Any) -> Any:
        if self._fn is None:
            raise RuntimeError("run() called before capture()")
        return self._fn(*inputs)

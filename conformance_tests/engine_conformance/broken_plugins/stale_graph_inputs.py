"""Broken: graph replay reuses the inputs seen at capture time instead of the ones it is given."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.interfaces.graph_capture import GraphCapture
from engine.interfaces.platform import Capabilities
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class StaleGraphCapture(GraphCapture):
    def __init__(self) -> None:
        self._fn: Callable[..., Any] | None = None
        self._captured: dict[int, tuple] = {}

    def capture(
        self, fn: Callable[..., Any], batch_sizes: list[int], make_inputs: Callable[[int], tuple]
    ) -> None:
        self._fn = fn
        self._captured = {bs: make_inputs(bs) for bs in batch_sizes}

    def run(self, batch_size: int, *inputs: Any) -> Any:
        assert self._fn is not None
        return self._fn(*self._captured.get(batch_size, inputs))

    def captured_batch_sizes(self) -> list[int]:
        return sorted(self._captured)


class StaleGraphPlatform(ReferencePlatform):
    name = "broken-graph"

    def capabilities(self) -> Capabilities:
        base = super().capabilities()
        return Capabilities(**{**{f: getattr(base, f) for f in base.__slots__}, "graph_capture": True})

    def make_graph_capture(self) -> GraphCapture:
        return StaleGraphCapture()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [StaleGraphPlatform]

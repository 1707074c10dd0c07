"""Broken: claims ``graph_capture_collectives``, but its graphs' collectives ran only while recording.

The way the claim goes wrong on a device: the collective runs while a graph records but is not recorded
into it, so each replay finds the collective's output as recording left it. Here each bucket's recording
keeps what its collectives returned, and its replays hand that back instead of exchanging anything (the
local work reads the new inputs). Both ranks skip alike, so nothing hangs: only the numbers are wrong, and
the eager collectives (every other ``distributed`` row) are right.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from engine.interfaces.communicator import Communicator
from engine.interfaces.graph_capture import GraphCapture
from engine.interfaces.platform import Capabilities
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.communicator import TorchDistributedCommunicator
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class TapedCommunicator(TorchDistributedCommunicator):
    """Gloo collectives that, while a graph records, keep their results on the bucket's tape, and while it
    replays return the tape's results in order without exchanging anything."""

    def __init__(self, world_size: int, rank: int, init_method: str, local_rank: int = 0) -> None:
        super().__init__(world_size, rank, init_method, local_rank)
        self._tape: list[torch.Tensor] | None = None
        self._replaying = False
        self._cursor = 0

    @contextmanager
    def taping(self, tape: list[torch.Tensor], replaying: bool) -> Iterator[None]:
        """Record onto ``tape`` (``replaying=False``) or play it back, for the duration of the block."""
        self._tape, self._replaying, self._cursor = tape, replaying, 0
        try:
            yield
        finally:
            self._tape = None

    def _taped(self, exchange: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self._tape is None:
            return exchange()
        if self._replaying:
            self._cursor += 1
            return self._tape[self._cursor - 1].clone()
        out = exchange()
        self._tape.append(out.clone())
        return out

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        result = self._taped(lambda: TorchDistributedCommunicator.all_reduce(self, tensor))
        if result is not tensor:  # the contract's in-place sum, from the tape
            tensor.copy_(result)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self._taped(lambda: TorchDistributedCommunicator.all_gather(self, tensor, dim))


class TapedGraphCapture(GraphCapture):
    """Runs each bucket's step once while "recording" its collectives, then replays with them taped."""

    def __init__(self, platform: BakedCollectivesPlatform) -> None:
        self._platform = platform
        self._fn: Callable[..., Any] | None = None
        self._tapes: dict[int, list[torch.Tensor]] = {}

    def _taping(self, tape: list[torch.Tensor], replaying: bool) -> Any:
        comm = self._platform.communicator
        return nullcontext() if comm is None else comm.taping(tape, replaying)

    def capture(
        self, fn: Callable[..., Any], batch_sizes: list[int], make_inputs: Callable[[int], tuple]
    ) -> None:
        self._fn = fn
        self._tapes.clear()
        for size in sorted(set(batch_sizes), reverse=True):
            tape: list[torch.Tensor] = []
            with self._taping(tape, replaying=False):
                fn(*make_inputs(size))
            self._tapes[size] = tape

    def run(self, batch_size: int, *inputs: Any) -> Any:
        if self._fn is None:
            raise RuntimeError("run() called before capture()")
        tape = self._tapes.get(batch_size)
        if tape is None:
            return self._fn(*inputs)
        with self._taping(tape, replaying=True):
            return self._fn(*inputs)

    def captured_batch_sizes(self) -> list[int]:
        return sorted(self._tapes)


class BakedCollectivesPlatform(ReferencePlatform):
    name = "broken-graph-collectives"

    def __init__(self) -> None:
        #: the communicator this process made, which the graphs tape
        self.communicator: TapedCommunicator | None = None

    def capabilities(self) -> Capabilities:
        return dataclasses.replace(
            super().capabilities(), distributed=True, graph_capture=True, graph_capture_collectives=True
        )

    def make_communicator(
        self, world_size: int, rank: int, init_method: str, local_rank: int = 0
    ) -> Communicator:
        self.communicator = TapedCommunicator(world_size, rank, init_method, local_rank)
        return self.communicator

    def make_graph_capture(self) -> GraphCapture:
        return TapedGraphCapture(self)


@hookimpl
def engine_register_platforms() -> list[type]:
    return [BakedCollectivesPlatform]

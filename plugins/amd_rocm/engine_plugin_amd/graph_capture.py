"""HIP graphs for decode steps through torch's graph API (``torch.cuda.CUDAGraph`` is HIP under ROCm).

One graph per batch-size bucket, captured largest first into one shared memory pool, replayed over
static input buffers. A batch size without a graph runs eagerly (the documented fallback).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.interfaces.graph_capture import GraphCapture

logger = logging.getLogger(__name__)

#: eager runs before a capture: Triton compiles and hipBLASLt picks its kernels outside the graph
WARMUP_RUNS = 2


@dataclass(slots=True)
class CapturedStep:
    graph: Any
    inputs: tuple
    output: Any


class HipGraphCapture(GraphCapture):
    """Records ``fn`` once per bucket; replays copy the new inputs into the captured buffers.

    Replay returns the graph's static output: the next replay of the same bucket overwrites it.
    """

    def __init__(self) -> None:
        self._fn: Callable[..., Any] | None = None
        self._steps: dict[int, CapturedStep] = {}

    def capture(self, fn: Callable[..., Any], batch_sizes: list[int], make_inputs: Callable[[int], tuple]) -> None:
        self._fn = fn
        self._steps.clear()
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for size in sorted(set(batch_sizes), reverse=True):
            inputs = tuple(make_inputs(size))
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    fn(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = fn(*inputs)
            self._steps[size] = CapturedStep(graph, inputs, output)
        torch.cuda.synchronize()
        logger.info("captured HIP graphs for batch sizes %s", sorted(self._steps))

    def run(self, batch_size: int, *inputs: Any) -> Any:
        step = self._steps.get(batch_size)
        if step is None:
            if self._fn is None:
                raise RuntimeError("run() called before capture()")
            return self._fn(*inputs)
        if len(inputs) != len(step.inputs):
            raise ValueError(f"the graph for batch size {batch_size} takes {len(step.inputs)} inputs, got {len(inputs)}")
        for static, new in zip(step.inputs, inputs, strict=True):
            if isinstance(static, torch.Tensor) and new is not static:
                if static.shape != new.shape:
                    raise ValueError(
                        f"input shape {tuple(new.shape)} differs from the captured {tuple(static.shape)} "
                        f"(batch size {batch_size})"
                    )
                static.copy_(new)
        step.graph.replay()
        return step.output

    def captured_batch_sizes(self) -> list[int]:
        return sorted(self._steps)

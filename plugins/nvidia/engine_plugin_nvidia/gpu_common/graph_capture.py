"""Device graphs for decode steps through torch's graph API: one graph per batch-size bucket, replayed
over static input buffers.

``torch.cuda.CUDAGraph`` records a CUDA graph on NVIDIA and a HIP graph under ROCm, so one implementation
serves both; the vendor subclasses set only the label and logger their messages use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.interfaces.graph_capture import GraphCapture

#: eager runs before a capture: Triton compiles and the BLAS library picks its kernels outside the graph
WARMUP_RUNS = 2


@dataclass(slots=True)
class CapturedStep:
    """One bucket's graph with the static inputs it reads and the static output it writes."""

    graph: Any
    inputs: tuple
    output: Any


@dataclass(frozen=True, slots=True)
class CaptureReport:
    """What capturing cost: buckets, seconds, and device memory the graphs' private pool holds."""

    batch_sizes: tuple[int, ...]
    seconds: float
    memory_bytes: int


class TorchGraphCapture(GraphCapture):
    """Records ``fn`` once per bucket into graphs sharing one memory pool; replays copy new inputs in.

    Buckets are captured largest first so that the smaller graphs reuse the largest one's memory.
    A batch size without a graph runs eagerly (the documented fallback). Replay returns the graph's
    static output tensor: it is overwritten by the next replay of the same bucket.
    """

    #: what the log calls the graphs (``"CUDA"``, ``"HIP"``)
    graph_label: ClassVar[str] = "GPU"
    #: vendor subclasses log under their own module's name, where users look for it
    logger: ClassVar[logging.Logger] = logging.getLogger(__name__)

    def __init__(self) -> None:
        self._fn: Callable[..., Any] | None = None
        self._steps: dict[int, CapturedStep] = {}
        self.report: CaptureReport | None = None

    def capture(self, fn: Callable[..., Any], batch_sizes: list[int], make_inputs: Callable[[int], tuple]) -> None:
        self._fn = fn
        self._steps.clear()
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        start = time.perf_counter()
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
        free_after, _ = torch.cuda.mem_get_info()
        self.report = CaptureReport(
            tuple(sorted(self._steps)), time.perf_counter() - start, max(0, free_before - free_after)
        )
        self.logger.info(
            "captured %s graphs for %d batch sizes (%s) in %.1f s, using %.0f MiB",
            self.graph_label, len(self._steps), _sizes_text(self.report.batch_sizes), self.report.seconds,
            self.report.memory_bytes / 2**20,
        )  # fmt: skip

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


def _sizes_text(sizes: tuple[int, ...]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}..{sizes[-1]}"

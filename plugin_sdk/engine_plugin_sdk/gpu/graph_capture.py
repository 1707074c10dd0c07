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
    """What capturing cost: buckets, seconds, and device memory.

    ``memory_bytes`` is the device memory the process holds more after capturing than before, both read
    with the allocator's unused cache released (``torch.cuda.graph`` releases it on entry, so a reading
    without that would count the cache it dropped against the graphs, and once read 0).
    ``pool_bytes`` is the part of it in the graphs' private memory pool.
    """

    batch_sizes: tuple[int, ...]
    seconds: float
    memory_bytes: int
    pool_bytes: int = 0


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
        from engine_plugin_sdk.gpu.triton_kernels import pdl

        free_before = _free_bytes()
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        with pdl.for_capture():  # the graphs' kernels start while the one before drains (where the GPU can)
            self._record(fn, batch_sizes, make_inputs, pool, side)
        seconds = time.perf_counter() - start
        self.report = CaptureReport(
            tuple(sorted(self._steps)), seconds, max(0, free_before - _free_bytes()), _pool_bytes(pool)
        )
        self.logger.info(
            "captured %s graphs for %d batch sizes (%s) in %.1f s, using %.1f MiB (%.1f MiB in the graph pool)",
            self.graph_label, len(self._steps), _sizes_text(self.report.batch_sizes), self.report.seconds,
            self.report.memory_bytes / 2**20, self.report.pool_bytes / 2**20,
        )  # fmt: skip

    def _record(self, fn: Callable[..., Any], batch_sizes: list[int], make_inputs: Callable[[int], tuple],
                pool: Any, side: Any) -> None:
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

    def run(self, batch_size: int, *inputs: Any) -> Any:
        step = self._steps.get(batch_size)
        if step is None:
            if self._fn is None:
                raise RuntimeError("run() called before capture()")
            return self._fn(*inputs)
        if len(inputs) != len(step.inputs):
            raise ValueError(f"the graph for batch size {batch_size} takes {len(step.inputs)} inputs, got {len(inputs)}")
        # the copies in one multi-tensor op per dtype: at batch 1 each op is a fixed cost on the device
        by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for static, new in zip(step.inputs, inputs, strict=True):
            if isinstance(static, torch.Tensor) and new is not static:
                if static.shape != new.shape:
                    raise ValueError(
                        f"input shape {tuple(new.shape)} differs from the captured {tuple(static.shape)} "
                        f"(batch size {batch_size})"
                    )
                if new.dtype != static.dtype or new.device != static.device or not new.is_contiguous():
                    static.copy_(new)
                    continue
                statics, news = by_dtype.setdefault(static.dtype, ([], []))
                statics.append(static)
                news.append(new)
        for statics, news in by_dtype.values():
            torch._foreach_copy_(statics, news)
        step.graph.replay()
        return step.output

    def captured_batch_sizes(self) -> list[int]:
        return sorted(self._steps)


def _free_bytes() -> int:
    """Free device memory with the caching allocator's unused blocks handed back first."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


def _pool_bytes(pool: Any) -> int:
    """Bytes of the allocator segments that belong to the graph pool ``pool`` (0 if torch cannot say)."""
    try:
        segments = torch.cuda.memory_snapshot()
    except (RuntimeError, AttributeError):
        return 0
    want = tuple(pool)
    return sum(int(s.get("total_size", 0)) for s in segments if tuple(s.get("segment_pool_id", ())) == want)


def _sizes_text(sizes: tuple[int, ...]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}..{sizes[-1]}"

"""Decode steps compiled with ``torch.compile`` (inductor's C++ code generation) instead of recorded graphs.

A CPU has no launch queue to record, but a batch-1 decode step of a small model is mostly per-op
dispatch: a few hundred tiny tensor ops in Python. Compiling the step fuses the norms, rotary, casts and
activations into a few generated C++ loops and leaves the GEMM kernels and the paged attention (an
opaque custom op, see ``CpuAttentionBackend.captured_decode``) as calls between them.

The buckets are compiled at start-up (logged with their time); dynamic shapes let one compiled graph
serve several buckets, and inductor's on-disk cache makes a second start of the same model cheaper.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from engine_plugin_cpu.gemm import SINGLE_THREAD_MAX_ROWS
from engine_plugin_sdk import GraphCapture

logger = logging.getLogger(__name__)


class CompiledGraphCapture(GraphCapture):
    """``torch.compile`` of the step function, warmed up (compiled) for every bucket at capture time.

    Args:
        compile_fn: the compiler, ``torch.compile`` by default (tests may pass a cheaper backend).
    """

    def __init__(self, compile_fn: Callable[..., Any] | None = None) -> None:
        self._compile_fn = compile_fn or _default_compile
        self._fn: Callable[..., Any] | None = None
        self._compiled: Callable[..., Any] | None = None
        self._buckets: list[int] = []
        #: seconds spent compiling at capture, for logs and benchmarks
        self.compile_seconds = 0.0

    def capture(
        self, fn: Callable[..., Any], batch_sizes: list[int], make_inputs: Callable[[int], tuple]
    ) -> None:
        self._fn = fn
        self._compiled = self._compile_fn(fn)
        start = time.perf_counter()
        for size in sorted(batch_sizes):
            # running each bucket once compiles it (or finds a dynamic graph that already covers it)
            self._call(size, make_inputs(size))
        self.compile_seconds = time.perf_counter() - start
        self._buckets = sorted(batch_sizes)
        logger.info(
            "cpu: decode step compiled for %d buckets up to batch %d in %.1f s",
            len(self._buckets),
            self._buckets[-1] if self._buckets else 0,
            self.compile_seconds,
        )

    def run(self, batch_size: int, *inputs: Any) -> Any:
        if self._fn is None or self._compiled is None:
            raise RuntimeError("run() called before capture()")
        if batch_size not in self._buckets:
            return self._fn(*inputs)
        return self._call(batch_size, inputs)

    def _call(self, batch_size: int, inputs: tuple) -> Any:
        # The eager GEMM drops to one thread for small batches per call; compiled, the whole step does.
        # Generated kernels are specialised on the thread count, so compile and run under the same one.
        threads = torch.get_num_threads()
        if batch_size > SINGLE_THREAD_MAX_ROWS or threads == 1:
            return self._compiled(*inputs)
        torch.set_num_threads(1)
        try:
            return self._compiled(*inputs)
        finally:
            torch.set_num_threads(threads)

    def captured_batch_sizes(self) -> list[int]:
        return list(self._buckets)


def _default_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    # dynamic=None: the first bucket compiles static, the next one recompiles with a symbolic batch
    # that then covers the rest (branches on the row count add at most a graph or two)
    return torch.compile(fn, fullgraph=True)

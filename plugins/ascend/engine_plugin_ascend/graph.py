"""NPU graph capture of decode steps: which batch sizes to capture, and replay with fresh inputs.

A captured NPU graph replays on the memory it was captured with, so :meth:`AscendGraphCapture.run`
copies each new input into the captured input tensors before replaying and returns the captured output
tensor (overwritten by the next replay of that bucket: clone it to keep it). A batch size without a
graph runs eagerly, the documented fallback. A caller that wants every decode step replayed pads its
batch to :func:`bucket_for`'s size.

The platform does not claim graph capture for the engine's decode steps yet (see
:meth:`engine_plugin_ascend.platform.AscendPlatform.capabilities`): the fused attention's sequence
lengths are host arguments a graph would freeze.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from engine_plugin_sdk import GraphCapture

#: small batches get their own graph (each padding row is a whole wasted sequence there)
SMALL_BUCKETS = (1, 2, 4, 8)
#: beyond them, one graph per this many sequences
BUCKET_STRIDE = 16


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture for a scheduler that runs at most ``max_num_seqs`` sequences.

    ``1, 2, 4, 8``, then every multiple of 16, and ``max_num_seqs`` itself so that a full batch needs
    no padding.

    Raises:
        ValueError: if ``max_num_seqs`` is not positive.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes = [b for b in SMALL_BUCKETS if b <= max_num_seqs]
    sizes += list(range(BUCKET_STRIDE, max_num_seqs + 1, BUCKET_STRIDE))
    return sorted({*sizes, max_num_seqs})


def bucket_for(batch_size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``batch_size`` rows, or None when none does (run eagerly)."""
    fitting = [b for b in buckets if b >= batch_size]
    return min(fitting) if fitting else None


def normalize_buckets(batch_sizes: Sequence[int]) -> list[int]:
    """Sorted, de-duplicated buckets.

    Raises:
        ValueError: for a size that is not a positive int.
    """
    bad = [b for b in batch_sizes if not isinstance(b, int) or isinstance(b, bool) or b < 1]
    if bad:
        raise ValueError(f"graph batch sizes must be positive ints, got {bad}")
    return sorted(set(batch_sizes))


@dataclass(slots=True)
class CapturedStep:
    """One bucket's graph with the tensors it reads and writes."""

    graph: Any
    inputs: tuple[Any, ...]
    output: Any


class AscendGraphCapture(GraphCapture):
    """One NPU graph per batch-size bucket, replayed with copied-in inputs.

    Args:
        kernels: the kernel module whose ``capture_graph`` / ``replay_graph`` record and replay.
    """

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels
        self._fn: Callable[..., Any] | None = None
        self._steps: dict[int, CapturedStep] = {}

    def capture(
        self, fn: Callable[..., Any], batch_sizes: list[int], make_inputs: Callable[[int], tuple]
    ) -> None:
        buckets = normalize_buckets(batch_sizes)
        self._fn = fn
        self._steps = {}
        for size in buckets:
            inputs = tuple(make_inputs(size))
            graph, output = self.kernels.capture_graph(fn, inputs)
            self._steps[size] = CapturedStep(graph, inputs, output)

    def run(self, batch_size: int, *inputs: Any) -> Any:
        if self._fn is None:
            raise RuntimeError("run() called before capture()")
        step = self._steps.get(batch_size)
        if step is None:
            return self._fn(*inputs)
        if len(inputs) != len(step.inputs):
            raise ValueError(
                f"batch size {batch_size} was captured with {len(step.inputs)} inputs, got {len(inputs)}"
            )
        for i, (static, fresh) in enumerate(zip(step.inputs, inputs, strict=True)):
            if isinstance(static, torch.Tensor):
                if (
                    not isinstance(fresh, torch.Tensor)
                    or fresh.shape != static.shape
                    or fresh.dtype != static.dtype
                ):
                    raise ValueError(
                        f"input {i} for batch size {batch_size} must be a {static.dtype} tensor of shape "
                        f"{tuple(static.shape)}, as captured"
                    )
                if fresh is not static:
                    static.copy_(fresh)
            elif fresh != static:
                raise ValueError(
                    f"non-tensor input {i} changed since capture ({static!r} -> {fresh!r}); recapture"
                )
        self.kernels.replay_graph(step.graph)
        return step.output

    def captured_batch_sizes(self) -> list[int]:
        return sorted(self._steps)

"""HIP graphs for decode steps through torch's graph API (``torch.cuda.CUDAGraph`` is HIP under ROCm).

The implementation is :mod:`engine_plugin_sdk.gpu.graph_capture`: one graph per batch-size
bucket, captured largest first into one shared memory pool, replayed over static input buffers. A batch
size without a graph runs eagerly (the documented fallback).
"""

from __future__ import annotations

import logging

from engine_plugin_sdk.gpu.graph_capture import WARMUP_RUNS, CapturedStep, CaptureReport, TorchGraphCapture

__all__ = ["WARMUP_RUNS", "CaptureReport", "CapturedStep", "HipGraphCapture"]


class HipGraphCapture(TorchGraphCapture):
    """Records ``fn`` once per bucket into HIP graphs; replays copy the new inputs into the captured buffers.

    Replay returns the graph's static output: the next replay of the same bucket overwrites it.
    """

    graph_label = "HIP"
    logger = logging.getLogger(__name__)

"""CUDA graphs for decode steps: the SDK's torch graph capture (:mod:`engine_plugin_sdk.gpu.graph_capture`)."""

from __future__ import annotations

import logging

from engine_plugin_sdk.gpu.graph_capture import WARMUP_RUNS, CapturedStep, CaptureReport, TorchGraphCapture

__all__ = ["WARMUP_RUNS", "CaptureReport", "CapturedStep", "CudaGraphCapture"]


class CudaGraphCapture(TorchGraphCapture):
    """Records ``fn`` once per bucket into CUDA graphs sharing one memory pool; replays copy new inputs in.

    Buckets are captured largest first so that the smaller graphs reuse the largest one's memory.
    A batch size without a graph runs eagerly (the documented fallback). Replay returns the graph's
    static output tensor: it is overwritten by the next replay of the same bucket.
    """

    graph_label = "CUDA"
    logger = logging.getLogger(__name__)

"""Checkpoints quantized ahead of time (GPTQ, AWQ, compressed-tensors, FP8): their ``quantization_config``
read into a :class:`CheckpointQuantization`, and their per-layer tensors regrouped into one
:class:`~engine.interfaces.gemm.QuantizedWeight` per matrix in the plugin API's layouts."""

from __future__ import annotations

from engine.loader.prequantized.config import CheckpointQuantization, checkpoint_quantization
from engine.loader.prequantized.stream import regroup_quantized

__all__ = ["CheckpointQuantization", "checkpoint_quantization", "regroup_quantized"]

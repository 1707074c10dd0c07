"""The contract between the core and hardware plugins."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine.interfaces.communicator import Communicator
from engine.interfaces.gemm import GemmBackend, QuantizedWeight
from engine.interfaces.graph_capture import EagerGraphCapture, GraphCapture
from engine.interfaces.platform import Capabilities, DetectResult, Platform
from engine.interfaces.step_overlap import Lane, SerialStepOverlap, StepOverlap

if TYPE_CHECKING:
    from engine.interfaces.ops import OP_NAMES, OpTable, reference_ops

# the op table imports torch: loaded on first use, so that finding and detecting plugins
# (``engine plugins list``) imports no torch
_LAZY = dict.fromkeys(("OP_NAMES", "OpTable", "reference_ops"), "engine.interfaces.ops")

__all__ = [
    "OP_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "BlockCache",
    "Capabilities",
    "Communicator",
    "DetectResult",
    "EagerGraphCapture",
    "GemmBackend",
    "GraphCapture",
    "KVCacheSpec",
    "Lane",
    "OpTable",
    "Platform",
    "QuantizedWeight",
    "SerialStepOverlap",
    "StepOverlap",
    "reference_ops",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.interfaces' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

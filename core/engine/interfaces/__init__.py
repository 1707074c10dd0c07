"""The contract between the core and hardware plugins."""

from __future__ import annotations

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine.interfaces.gemm import GemmBackend, QuantizedWeight
from engine.interfaces.graph_capture import EagerGraphCapture, GraphCapture
from engine.interfaces.ops import OP_NAMES, OpTable, reference_ops
from engine.interfaces.platform import Capabilities, DetectResult, Platform

__all__ = [
    "OP_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "BlockCache",
    "Capabilities",
    "DetectResult",
    "EagerGraphCapture",
    "GemmBackend",
    "GraphCapture",
    "KVCacheSpec",
    "OpTable",
    "Platform",
    "QuantizedWeight",
    "reference_ops",
]

"""The plugin SDK: everything a hardware vendor needs to build an engine plugin, from one import.

- the contract: :class:`Platform`, :class:`AttentionBackend`, :class:`GemmBackend`, :class:`BlockCache`,
  :class:`GraphCapture` and their data types (re-exported from :mod:`engine.interfaces`);
- the hook marker :data:`hookimpl` and the plugin API version this core implements;
- reference implementations of every op (:mod:`engine_plugin_sdk.reference_ops`), plain backends built
  from them (:mod:`engine_plugin_sdk.reference_backends`), the tolerance table
  (:mod:`engine_plugin_sdk.tolerances`), and random problem builders
  (:func:`make_attention_problem`, :func:`make_quantized_weight`);
- :func:`scaffold_plugin`, behind ``engine plugin new``.

See docs/plugins.md for the guide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.interfaces import (
    OP_NAMES,
    AttentionBackend,
    AttentionMetadata,
    BlockCache,
    Capabilities,
    DetectResult,
    EagerGraphCapture,
    GemmBackend,
    GraphCapture,
    KVCacheSpec,
    OpTable,
    Platform,
    QuantizedWeight,
    reference_ops,
)
from engine.plugins.hookspecs import hookimpl
from engine.plugins.manager import PLUGIN_API_VERSION, check_api_compatibility

if TYPE_CHECKING:
    from engine_plugin_sdk.problems import AttentionProblem, make_attention_problem
    from engine_plugin_sdk.quant import make_quantized_weight
    from engine_plugin_sdk.reference_platform import ReferencePlatform
    from engine_plugin_sdk.scaffold import scaffold_plugin
    from engine_plugin_sdk.tolerances import TOLERANCES, Tolerance, get_tolerance

#: the range a plugin built against this SDK declares as ``ENGINE_PLUGIN_API``
DEFAULT_API_SPEC = ">=1.0,<2"

# loaded on first use so that ``import engine_plugin_sdk`` in a plugin module stays cheap
_LAZY = {
    "AttentionProblem": "engine_plugin_sdk.problems",
    "make_attention_problem": "engine_plugin_sdk.problems",
    "make_quantized_weight": "engine_plugin_sdk.quant",
    "ReferencePlatform": "engine_plugin_sdk.reference_platform",
    "scaffold_plugin": "engine_plugin_sdk.scaffold",
    "TOLERANCES": "engine_plugin_sdk.tolerances",
    "Tolerance": "engine_plugin_sdk.tolerances",
    "get_tolerance": "engine_plugin_sdk.tolerances",
}

__all__ = [
    "DEFAULT_API_SPEC",
    "OP_NAMES",
    "PLUGIN_API_VERSION",
    "TOLERANCES",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionProblem",
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
    "ReferencePlatform",
    "Tolerance",
    "check_api_compatibility",
    "get_tolerance",
    "hookimpl",
    "make_attention_problem",
    "make_quantized_weight",
    "reference_ops",
    "scaffold_plugin",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_plugin_sdk' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

"""The plugin SDK: everything a hardware or model plugin is built with, from one import.

A plugin package imports ``engine_plugin_sdk`` and nothing else of the project (a test enforces it):

- the contract: :class:`Platform`, :class:`Capabilities`, :class:`AttentionBackend`, :class:`GemmBackend`,
  :class:`BlockCache`, :class:`GraphCapture`, :class:`StepOverlap`, :class:`PlatformModelRunner`,
  :class:`Communicator` and their data types;
- the hook marker :data:`hookimpl`, the plugin API version this core implements and the range a new
  plugin declares (:data:`DEFAULT_API_SPEC`);
- dtype helpers (:func:`torch_dtype`, :func:`dtype_name`, :func:`as_copyable`) and the one torch block pool
  (:class:`TorchBlockCache`); the one ``torch.distributed`` communicator
  (:class:`TorchDistributedCommunicator`, :mod:`engine_plugin_sdk.communicator`) and the collectives'
  float64 references (:mod:`engine_plugin_sdk.reference_collectives`);
- the model-building blocks for model plugins (:mod:`engine_plugin_sdk.models`: the model base class,
  :class:`ModelConfig`, weight helpers, rotary tables, the core's Llama family to subclass);
- reference implementations of every op (:mod:`engine_plugin_sdk.reference_ops`), plain backends built
  from them (:mod:`engine_plugin_sdk.reference_backends`), the tolerance table
  (:mod:`engine_plugin_sdk.tolerances`), random problem builders and the helpers a plugin's own tests use
  (:mod:`engine_plugin_sdk.testing`);
- the vendor-neutral GPU layer shared by torch + Triton plugins (:mod:`engine_plugin_sdk.gpu`, needs the
  ``engine[gpu]`` extra);
- :func:`scaffold_plugin`, behind ``engine plugin new``.

Everything but the contract loads on first use, so ``import engine_plugin_sdk`` in a plugin's hook module
stays cheap. See docs/plugins.md for the guide.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.interfaces import (
    AttentionBackend,
    AttentionMetadata,
    BlockCache,
    Capabilities,
    Communicator,
    DetectResult,
    EagerGraphCapture,
    GemmBackend,
    GraphCapture,
    KVCacheSpec,
    Lane,
    Platform,
    QuantizedWeight,
    SerialStepOverlap,
    StepOverlap,
)
from engine.plugins.hookspecs import hookimpl
from engine.plugins.manager import PLUGIN_API_VERSION, check_api_compatibility

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.interfaces.attention import HeadNorm, RotaryInput
    from engine.interfaces.gemm import ACTIVATIONS_KEY, PER_TOKEN_ACTIVATIONS, RowQuantizedActivations
    from engine.interfaces.grouped_int import (
        GROUPED_INT_BITS,
        INT4_GROUPED,
        INT8_GROUPED,
        dequantize_stored,
        grouped_int_codes,
        grouped_int_weight,
        pack_int4,
        unpack_int4,
    )
    from engine.interfaces.lora import (
        GroupedLoraRows,
        LoraStep,
        LoraWeights,
        group_lora_rows,
        grouped_add_lora,
        reference_add_lora,
    )
    from engine.interfaces.model_runner import FlatStep, PlatformModelRunner
    from engine.interfaces.moe import ExpertWeights, expert_activation, reference_fused_moe
    from engine.interfaces.ops import CORE_OP_NAMES, OP_NAMES, OpTable, silu_and_mul
    from engine.interfaces.ops import reference_ops as reference_op_table
    from engine_plugin_sdk.communicator import TorchDistributedCommunicator
    from engine_plugin_sdk.dtypes import as_copyable, dtype_name, torch_dtype
    from engine_plugin_sdk.problems import AttentionProblem, make_attention_problem
    from engine_plugin_sdk.quant import make_quantized_weight
    from engine_plugin_sdk.reference_platform import ReferencePlatform
    from engine_plugin_sdk.scaffold import scaffold_plugin
    from engine_plugin_sdk.tolerances import TOLERANCES, Tolerance, get_tolerance
    from engine_plugin_sdk.torch_block_cache import TorchBlockCache

#: the range a plugin built against this SDK declares as ``ENGINE_PLUGIN_API``
DEFAULT_API_SPEC = ">=2.0,<3"

# loaded on first use so that ``import engine_plugin_sdk`` in a plugin module stays cheap (the op table
# imports torch); ``module:attribute`` where the name differs
_LAZY = {
    "OP_NAMES": "engine.interfaces.ops",
    "OpTable": "engine.interfaces.ops",
    # the core's torch ops as an OpTable; not ``reference_ops``, which names the float64 reference module
    "reference_op_table": "engine.interfaces.ops:reference_ops",
    "ACTIVATIONS_KEY": "engine.interfaces.gemm",
    "PER_TOKEN_ACTIVATIONS": "engine.interfaces.gemm",
    "RowQuantizedActivations": "engine.interfaces.gemm",
    # one layer's rotation, for an attention backend that fuses it (AttentionBackend.forward_rotary)
    "RotaryInput": "engine.interfaces.attention",
    "HeadNorm": "engine.interfaces.attention",
    # the grouped-integer weight layout (GPTQ / AWQ / compressed-tensors W4A16 and W8A16)
    "GROUPED_INT_BITS": "engine.interfaces.grouped_int",
    "INT4_GROUPED": "engine.interfaces.grouped_int",
    "INT8_GROUPED": "engine.interfaces.grouped_int",
    "dequantize_stored": "engine.interfaces.grouped_int",
    "grouped_int_codes": "engine.interfaces.grouped_int",
    "grouped_int_weight": "engine.interfaces.grouped_int",
    "pack_int4": "engine.interfaces.grouped_int",
    "unpack_int4": "engine.interfaces.grouped_int",
    # batched LoRA: the adapters' layout, a step's slots, the default plan and product, the float64 meaning
    "GroupedLoraRows": "engine.interfaces.lora",
    "LoraStep": "engine.interfaces.lora",
    "LoraWeights": "engine.interfaces.lora",
    "group_lora_rows": "engine.interfaces.lora",
    "grouped_add_lora": "engine.interfaces.lora",
    "reference_add_lora": "engine.interfaces.lora",
    # mixtures of experts: the default experts' form, their activation and the per-expert product
    "ExpertWeights": "engine.interfaces.moe",
    "expert_activation": "engine.interfaces.moe",
    "reference_fused_moe": "engine.interfaces.moe",
    "CORE_OP_NAMES": "engine.interfaces.ops",
    # the core's torch ops, for a plugin kernel's fallback
    "silu_and_mul": "engine.interfaces.ops",
    "gelu_tanh_and_mul": "engine.interfaces.ops",
    "FlatStep": "engine.interfaces.model_runner",
    "PlatformModelRunner": "engine.interfaces.model_runner",
    "EngineConfig": "engine.config",
    "as_copyable": "engine_plugin_sdk.dtypes",
    "dtype_name": "engine_plugin_sdk.dtypes",
    "torch_dtype": "engine_plugin_sdk.dtypes",
    "TorchBlockCache": "engine_plugin_sdk.torch_block_cache",
    "TorchDistributedCommunicator": "engine_plugin_sdk.communicator",
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
    "ACTIVATIONS_KEY",
    "CORE_OP_NAMES",
    "DEFAULT_API_SPEC",
    "GROUPED_INT_BITS",
    "INT4_GROUPED",
    "INT8_GROUPED",
    "OP_NAMES",
    "PER_TOKEN_ACTIVATIONS",
    "PLUGIN_API_VERSION",
    "TOLERANCES",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionProblem",
    "BlockCache",
    "Capabilities",
    "Communicator",
    "DetectResult",
    "EagerGraphCapture",
    "EngineConfig",
    "ExpertWeights",
    "FlatStep",
    "GemmBackend",
    "GraphCapture",
    "GroupedLoraRows",
    "HeadNorm",
    "KVCacheSpec",
    "Lane",
    "LoraStep",
    "LoraWeights",
    "OpTable",
    "Platform",
    "PlatformModelRunner",
    "QuantizedWeight",
    "ReferencePlatform",
    "RotaryInput",
    "RowQuantizedActivations",
    "SerialStepOverlap",
    "StepOverlap",
    "Tolerance",
    "TorchBlockCache",
    "TorchDistributedCommunicator",
    "as_copyable",
    "check_api_compatibility",
    "dequantize_stored",
    "dtype_name",
    "expert_activation",
    "get_tolerance",
    "group_lora_rows",
    "gelu_tanh_and_mul",
    "grouped_add_lora",
    "grouped_int_codes",
    "grouped_int_weight",
    "hookimpl",
    "make_attention_problem",
    "make_quantized_weight",
    "pack_int4",
    "reference_fused_moe",
    "reference_add_lora",
    "reference_op_table",
    "scaffold_plugin",
    "silu_and_mul",
    "torch_dtype",
    "unpack_int4",
]


def __getattr__(name: str) -> Any:
    spec = _LAZY.get(name)
    if spec is None:
        raise AttributeError(f"module 'engine_plugin_sdk' has no attribute {name!r}")
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute or name)

"""Model-building blocks for model plugins and for plugins that run models themselves.

Re-exports of the core's definitions (one definition each), so a plugin imports them from the SDK:

- :class:`CausalLM`: the base class of every architecture. A model plugin subclasses it and returns
  ``{HF architecture name: class}`` from its ``engine_register_models`` hook (docs/plugins.md, "Writing a
  model plugin");
- :class:`ModelConfig` (the raw HF dict is its ``hf_config``), :func:`take_tensor` (shape-checked pop
  from a name -> tensor dict), :func:`build_cos_sin_cache` (rotary tables in the layout of the
  ``rotary_embedding`` op), :func:`concat_weights` (stack dense or quantized weights by rows, for fused
  projections);
- :class:`LlamaForCausalLM`, the core's Llama family, to read as an example or to subclass.

:class:`AttentionMetadata`, :class:`OpTable`, :class:`QuantizedWeight` and the backends come from
``engine_plugin_sdk`` itself. ``concat_weights`` and ``LlamaForCausalLM`` load on first use (they pull in
the loader), so importing this module stays cheap for runners that need only the config helpers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.models.base import CausalLM
from engine.models.config import ModelConfig
from engine.models.rotary import build_cos_sin_cache
from engine.models.weights import take_tensor

if TYPE_CHECKING:
    from engine.loader.quantized import concat_weights
    from engine.models.llama import LlamaForCausalLM

_LAZY = {"concat_weights": "engine.loader.quantized", "LlamaForCausalLM": "engine.models.llama"}

__all__ = [
    "CausalLM",
    "LlamaForCausalLM",
    "ModelConfig",
    "build_cos_sin_cache",
    "concat_weights",
    "take_tensor",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_plugin_sdk.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

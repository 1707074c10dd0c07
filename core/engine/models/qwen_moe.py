"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 layouts whose sparse layers are mixtures of experts."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from engine.interfaces.gemm import QuantizedWeight
from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import (
    EXPERT_NAMES,
    GLOBAL_NAMES,
    LAYER_NAMES,
    QK_NORM_NAMES,
    SHARED_EXPERT_NAMES,
    extend,
)
from engine.models.layers.hf_config import layer_windows
from engine.models.layers.spec import DecoderSpec, LayerSpec, MoeSpec
from engine.models.llama import standard_rope


def num_experts(hf: dict[str, Any]) -> int:
    """The experts per layer: ``num_experts`` as the Hub's configs spell it, ``num_local_experts`` as
    transformers 5 saves it."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def sparse_layers(hf: dict[str, Any], num_layers: int) -> list[bool]:
    """Which layers are mixtures of experts: every ``decoder_sparse_step``-th, except ``mlp_only_layers``
    (as the HF Qwen MoE models decide)."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return [i not in dense and num_experts(hf) > 0 and (i + 1) % step == 0 for i in range(num_layers)]


def qwen_moe_spec(config: ModelConfig, shared_expert: bool) -> MoeSpec:
    """The experts of a Qwen MoE config (``moe_intermediate_size`` wide; a gated shared expert for Qwen2)."""
    hf = config.hf_config
    return MoeSpec(
        num_experts=num_experts(hf),
        top_k=int(hf["num_experts_per_tok"]),
        renormalize=bool(hf.get("norm_topk_prob", False)),
        intermediate_size=int(hf["moe_intermediate_size"]),
        shared_intermediate_size=int(hf["shared_expert_intermediate_size"]) if shared_expert else None,
        shared_expert_gate="mlp.shared_expert_gate" if shared_expert else None,
    )


def qwen_moe_layers(config: ModelConfig) -> tuple[LayerSpec, ...]:
    """Each layer's window and whether it is a mixture of experts."""
    sparse = sparse_layers(config.hf_config, config.num_layers)
    windows = layer_windows(config.hf_config, config.num_layers)
    return tuple(LayerSpec(sliding_window=w, moe=s) for w, s in zip(windows, sparse))


class Qwen2MoeForCausalLM(DenseDecoder):
    """``Qwen2MoeForCausalLM``: q/k/v biases; experts without renormalisation by default, plus a shared
    expert behind a sigmoid gate."""

    gguf_architectures = MappingProxyType({"qwen2moe": "Qwen2MoeForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = extend(extend(LAYER_NAMES, EXPERT_NAMES), SHARED_EXPERT_NAMES)

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Qwen2's attention; sparse layers per ``decoder_sparse_step`` / ``mlp_only_layers``."""
        return DecoderSpec(
            layers=qwen_moe_layers(config),
            ropes=(standard_rope(config),),
            qkv_bias=True,
            moe=qwen_moe_spec(config, shared_expert=True),
        )

    @classmethod
    def gguf_restore(
        cls, gguf_architecture: str, name: str, weight: torch.Tensor | QuantizedWeight, config: ModelConfig
    ) -> list[tuple[str, torch.Tensor | QuantizedWeight]]:
        """The shared expert's gate is one row, which llama.cpp may store as a vector."""
        if name.endswith("shared_expert_gate.weight") and isinstance(weight, torch.Tensor):
            return [(name, weight.reshape(1, -1))]
        return [(name, weight)]


class Qwen3MoeForCausalLM(DenseDecoder):
    """``Qwen3MoeForCausalLM``: Qwen3's per-head q/k norms; experts renormalised per ``norm_topk_prob``."""

    gguf_architectures = MappingProxyType({"qwen3moe": "Qwen3MoeForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = extend(extend(LAYER_NAMES, QK_NORM_NAMES), EXPERT_NAMES)

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Qwen3's attention; sparse layers per ``decoder_sparse_step`` / ``mlp_only_layers``."""
        return DecoderSpec(
            layers=qwen_moe_layers(config),
            ropes=(standard_rope(config),),
            qk_norm="head",
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            moe=qwen_moe_spec(config, shared_expert=False),
        )

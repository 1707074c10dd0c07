"""Gemma 2: sandwich norms in Gemma's ``1 + w`` form, GeGLU, scaled embeddings, alternating local and
global layers, attention and final logit soft-caps, ``query_pre_attn_scalar``."""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar

import torch

from engine.interfaces.gemm import QuantizedWeight
from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, extend
from engine.models.layers.hf_config import FULL, SLIDING, layer_windows
from engine.models.layers.spec import Activation, DecoderSpec, LayerSpec, NormNames
from engine.models.llama import standard_rope

#: Gemma's four norms per layer
GEMMA_NORMS = NormNames(
    pre_attn="input_layernorm",
    post_attn="post_attention_layernorm",
    pre_mlp="pre_feedforward_layernorm",
    post_mlp="post_feedforward_layernorm",
)

#: llama.cpp's names of Gemma's four norms (``ffn_norm`` is the pre-MLP one)
GEMMA_GGUF_LAYER_NAMES = extend(
    LAYER_NAMES,
    {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
)


def gemma_activation(hf: dict) -> Activation:
    """GeGLU for Gemma's ``gelu_pytorch_tanh`` (the only activation the family ships).

    Raises:
        ValueError: another activation.
    """
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma activation {act!r} is not supported (supported: gelu_pytorch_tanh)")
    return "gelu_tanh"


def optional_float(value: object) -> float | None:
    """``float(value)``, None for an absent or null value."""
    return None if value is None else float(value)  # type: ignore[arg-type]


class Gemma2ForCausalLM(DenseDecoder):
    """``Gemma2ForCausalLM``. Loads llama.cpp's ``gemma2`` GGUF files, whose converter stores every norm
    scale as ``1 + w`` (undone at load)."""

    tie_embeddings_default: ClassVar[bool] = True
    gguf_architectures = MappingProxyType({"gemma2": "Gemma2ForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = GEMMA_GGUF_LAYER_NAMES

    @classmethod
    def gguf_restore(
        cls, gguf_architecture: str, name: str, weight: torch.Tensor | QuantizedWeight, config: ModelConfig
    ) -> list[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Norm scales back from llama.cpp's ``1 + w`` to HF's ``w`` (norms are never quantized)."""
        if name.endswith("norm.weight") and isinstance(weight, torch.Tensor):
            return [(name, weight - 1.0)]
        return [(name, weight)]

    @classmethod
    def is_norm_scale(cls, name: str) -> bool:
        """Gemma stores norm scales as ``w`` of ``1 + w``: dummy weights draw them around 0."""
        return False

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Sandwich-norm GeGLU layers; even layers slide when the config lists no ``layer_types``."""
        hf, n = config.hf_config, config.num_layers
        default = [SLIDING if i % 2 == 0 else FULL for i in range(n)]
        return DecoderSpec(
            layers=tuple(LayerSpec(sliding_window=w) for w in layer_windows(hf, n, default)),
            ropes=(standard_rope(config),),
            norms=GEMMA_NORMS,
            gemma_norms=True,
            activation=gemma_activation(hf),
            scale=float(hf.get("query_pre_attn_scalar") or config.head_dim) ** -0.5,
            attn_soft_cap=optional_float(hf.get("attn_logit_softcapping")),
            embed_scale=config.hidden_size**0.5,
            final_soft_cap=optional_float(hf.get("final_logit_softcapping")),
        )

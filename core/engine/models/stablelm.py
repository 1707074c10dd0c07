"""StableLM (``StableLmForCausalLM``): LayerNorms with biases, a partial rotary, optional q/k/v biases,
per-head q/k LayerNorms and GPT-NeoX's parallel residual."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from engine.interfaces.gemm import QuantizedWeight
from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, extend
from engine.models.layers.spec import DecoderSpec, LayerSpec, NormNames
from engine.models.llama import standard_rope

#: ``StableLmConfig``'s ``partial_rotary_factor`` when a config.json leaves it out
DEFAULT_PARTIAL_ROTARY = 0.25


class StableLmForCausalLM(DenseDecoder):
    """``StableLmForCausalLM``: ``use_qkv_bias``, ``qk_layernorm`` (one LayerNorm scale per head, stored
    per head) and ``use_parallel_residual`` (attention and MLP from the one input norm; no
    ``post_attention_layernorm`` then). Loads llama.cpp's ``stablelm`` GGUF files, whose converter stacks
    the per-head q/k norm scales into one ``[heads, head_dim]`` tensor (split again at load)."""

    gguf_architectures = MappingProxyType({"stablelm": "StableLmForCausalLM"})
    gguf_global_tensor_names = extend(GLOBAL_NAMES, {"output_norm.bias": "model.norm.bias"})
    gguf_layer_tensor_names = extend(
        LAYER_NAMES,
        {
            "attn_norm.bias": "input_layernorm.bias",
            "ffn_norm.bias": "post_attention_layernorm.bias",
            "attn_q_norm.weight": "self_attn.q_layernorm.weight",
            "attn_k_norm.weight": "self_attn.k_layernorm.weight",
        },
    )

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Pre-LayerNorm SwiGLU layers, sequential or parallel."""
        hf = config.hf_config
        parallel = bool(hf.get("use_parallel_residual", False))
        return DecoderSpec(
            layers=tuple(LayerSpec() for _ in range(config.num_layers)),
            ropes=(standard_rope(config),),
            norms=NormNames(pre_attn="input_layernorm", pre_mlp=None if parallel else "post_attention_layernorm"),
            norm="layer",
            norm_bias=True,
            qk_norm="each_head" if hf.get("qk_layernorm", False) else "none",
            qk_norm_names=("self_attn.q_layernorm", "self_attn.k_layernorm"),
            qk_norm_split=True,
            qkv_bias=bool(hf.get("use_qkv_bias", False)),
            parallel=parallel,
        )

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """``layer_norm_eps`` is the norms' epsilon; the rotary covers a quarter of each head unless set."""
        hf = dict(hf_config)
        nested = hf.get("rope_parameters")
        if hf.get("partial_rotary_factor") is None and not (isinstance(nested, dict) and "partial_rotary_factor" in nested):
            hf["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY
        config = super().config_from_hf(hf)
        config.rms_norm_eps = float(hf.get("layer_norm_eps", 1e-5))
        return config

    @classmethod
    def is_norm_scale(cls, name: str) -> bool:
        """The per-head q/k scales (``q_layernorm.norms.{h}.weight``) are norm scales too."""
        return super().is_norm_scale(name) or (".norms." in name and name.endswith(".weight"))

    @classmethod
    def gguf_restore(
        cls, gguf_architecture: str, name: str, weight: torch.Tensor | QuantizedWeight, config: ModelConfig
    ) -> list[tuple[str, torch.Tensor | QuantizedWeight]]:
        """The stacked q/k norm scales back into HF's one tensor per head (``{norm}.norms.{h}.weight``)."""
        if not name.endswith(("self_attn.q_layernorm.weight", "self_attn.k_layernorm.weight")):
            return [(name, weight)]
        dense = weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
        stem = name[: -len(".weight")]
        return [(f"{stem}.norms.{h}.weight", row.contiguous()) for h, row in enumerate(dense)]

"""Cohere Command-R (``CohereForCausalLM``): bias-free LayerNorms, attention and MLP in parallel from one
norm, an interleaved rotary, a logit scale and tied embeddings."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, QK_NORM_NAMES, extend
from engine.models.layers.spec import DecoderSpec, LayerSpec, NormNames
from engine.models.llama import standard_rope

#: ``CohereConfig``'s ``logit_scale`` when a config.json leaves it out
DEFAULT_LOGIT_SCALE = 0.0625


class CohereForCausalLM(DenseDecoder):
    """``CohereForCausalLM``: the rotary turns pairs ``(2i, 2i+1)`` (the loader reorders the Q/K rows, and
    ``use_qk_norm``'s per-head scales with them, into halves); ``attention_bias`` also biases o_proj.
    Loads llama.cpp's ``command-r`` GGUF files (rows as HF stores them: llama.cpp's rotary pairs adjacent
    dims as Cohere's does; q/k norms as ``[heads, head_dim]``)."""

    tie_embeddings_default: ClassVar[bool] = True
    gguf_architectures = MappingProxyType({"command-r": "CohereForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = extend(LAYER_NAMES, QK_NORM_NAMES, drop=("ffn_norm.weight",))

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Parallel LayerNorm SwiGLU layers with an interleaved rotary."""
        hf = config.hf_config
        return DecoderSpec(
            layers=tuple(LayerSpec() for _ in range(config.num_layers)),
            ropes=(standard_rope(config, interleaved=True),),
            norms=NormNames(pre_attn="input_layernorm", pre_mlp=None),
            norm="layer",
            qk_norm="each_head" if hf.get("use_qk_norm", False) else "none",
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            parallel=True,
            logit_scale=float(hf.get("logit_scale", DEFAULT_LOGIT_SCALE)),
        )

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """``layer_norm_eps`` is the norms' epsilon."""
        config = super().config_from_hf(hf_config)
        config.rms_norm_eps = float(hf_config.get("layer_norm_eps", 1e-5))
        return config

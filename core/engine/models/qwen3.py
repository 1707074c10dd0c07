"""Qwen3: the Llama layout with a per-head RMSNorm on queries and keys before the rotary."""

from __future__ import annotations

from types import MappingProxyType

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, QK_NORM_NAMES, extend
from engine.models.layers.hf_config import layer_windows
from engine.models.layers.spec import DecoderSpec, LayerSpec
from engine.models.llama import standard_rope


class Qwen3ForCausalLM(DenseDecoder):
    """``Qwen3ForCausalLM``: q/k norms per head; ``attention_bias`` biases q, k, v and o. Loads llama.cpp's
    ``qwen3`` GGUF files (rows as HF stores them)."""

    gguf_architectures = MappingProxyType({"qwen3": "Qwen3ForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = extend(LAYER_NAMES, QK_NORM_NAMES)

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Pre-norm SwiGLU layers, q/k RMSNorm per head, windows from ``layer_types``."""
        windows = layer_windows(config.hf_config, config.num_layers)
        return DecoderSpec(
            layers=tuple(LayerSpec(sliding_window=w) for w in windows),
            ropes=(standard_rope(config),),
            qk_norm="head",
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
        )

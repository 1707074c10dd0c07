"""Granite: the Llama layout with multipliers on the embeddings, the residual branches, the attention
scores and the logits."""

from __future__ import annotations

from types import MappingProxyType

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, llama_permuted_heads
from engine.models.layers.spec import DecoderSpec, LayerSpec
from engine.models.llama import standard_rope


class GraniteForCausalLM(DenseDecoder):
    """``GraniteForCausalLM``: ``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier``
    (the softmax scale) and ``logits_scaling`` (logits are divided by it). Loads llama.cpp's ``granite``
    GGUF files, whose converter permutes the Q/K rows as for ``llama``."""

    gguf_architectures = MappingProxyType({"granite": "GraniteForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = LAYER_NAMES

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Pre-norm SwiGLU layers with Granite's four multipliers."""
        hf = config.hf_config
        return DecoderSpec(
            layers=tuple(LayerSpec() for _ in range(config.num_layers)),
            ropes=(standard_rope(config),),
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            scale=float(hf.get("attention_multiplier", 1.0)),
            embed_scale=float(hf.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
            logits_divisor=float(hf.get("logits_scaling", 1.0)),
        )

    @classmethod
    def gguf_permuted_heads(cls, gguf_architecture: str, name: str, config: ModelConfig) -> int:
        """The ``granite`` converter is the ``llama`` one: Q/K rows interleaved per head."""
        return llama_permuted_heads(name, config)

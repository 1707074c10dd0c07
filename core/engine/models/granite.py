"""Granite: the Llama layout with multipliers on the embeddings, the residual branches, the attention
scores and the logits."""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.spec import DecoderSpec, LayerSpec
from engine.models.llama import standard_rope


class GraniteForCausalLM(DenseDecoder):
    """``GraniteForCausalLM``: ``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier``
    (the softmax scale) and ``logits_scaling`` (logits are divided by it)."""

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

"""GLM (``GlmForCausalLM``) and GLM-4 (``Glm4ForCausalLM``): partial interleaved rotary, q/k/v biases,
a fused gate/up projection; GLM-4 adds norms on each branch's output."""

from __future__ import annotations

from types import MappingProxyType

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, extend
from engine.models.layers.spec import DecoderSpec, LayerSpec, NormNames
from engine.models.llama import standard_rope


class GlmForCausalLM(DenseDecoder):
    """``GlmForCausalLM``: the rotary turns pairs ``(2i, 2i+1)`` of the first ``partial_rotary_factor``
    of each head (the loader reorders the Q/K rows into halves)."""

    #: per-layer norm names (GLM-4 adds the two branch-output norms)
    norm_names = NormNames()

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Pre-norm SwiGLU layers with a fused gate/up and an interleaved partial rotary."""
        return DecoderSpec(
            layers=tuple(LayerSpec() for _ in range(config.num_layers)),
            ropes=(standard_rope(config, interleaved=True),),
            norms=cls.norm_names,
            qkv_bias=bool(config.hf_config.get("attention_bias", True)),
            fused_gate_up="mlp.gate_up_proj",
        )

    @classmethod
    def config_from_hf(cls, hf_config: dict) -> ModelConfig:
        """GLM's ``attention_bias`` defaults to true."""
        config = super().config_from_hf(hf_config)
        config.attention_bias = bool(hf_config.get("attention_bias", True))
        return config


class Glm4ForCausalLM(GlmForCausalLM):
    """``Glm4ForCausalLM``: GLM with ``post_self_attn_layernorm`` and ``post_mlp_layernorm``. Loads
    llama.cpp's ``glm4`` GGUF files: rows as HF stores them (llama.cpp's rotary pairs adjacent dims as
    GLM's does), the fused gate/up as ``ffn_up``."""

    gguf_architectures = MappingProxyType({"glm4": "Glm4ForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = extend(
        LAYER_NAMES,
        {
            "post_attention_norm.weight": "post_self_attn_layernorm.weight",
            "ffn_up.weight": "mlp.gate_up_proj.weight",
            "post_ffw_norm.weight": "post_mlp_layernorm.weight",
        },
        drop=("ffn_gate.weight",),
    )

    norm_names = NormNames(
        pre_attn="input_layernorm",
        post_attn="post_self_attn_layernorm",
        pre_mlp="post_attention_layernorm",
        post_mlp="post_mlp_layernorm",
    )

"""OLMo 2: norms on each branch's output only (no pre-norms), and RMSNorm over all query and key heads."""

from __future__ import annotations

from types import MappingProxyType

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, QK_NORM_NAMES, extend
from engine.models.layers.spec import DecoderSpec, LayerSpec, NormNames
from engine.models.llama import standard_rope


class Olmo2ForCausalLM(DenseDecoder):
    """``Olmo2ForCausalLM``: post-norm residual branches, full-width q/k norms. Loads llama.cpp's ``olmo2``
    GGUF files (rows as HF stores them)."""

    gguf_architectures = MappingProxyType({"olmo2": "Olmo2ForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = extend(
        LAYER_NAMES,
        {
            **QK_NORM_NAMES,
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        },
        drop=("attn_norm.weight", "ffn_norm.weight"),
    )

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Post-norm SwiGLU layers with full-width q/k RMSNorm."""
        return DecoderSpec(
            layers=tuple(LayerSpec() for _ in range(config.num_layers)),
            ropes=(standard_rope(config),),
            norms=NormNames(pre_attn=None, post_attn="post_attention_layernorm", pre_mlp=None, post_mlp="post_feedforward_layernorm"),
            qk_norm="full",
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
        )

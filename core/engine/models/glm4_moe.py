"""GLM-4.5 (``Glm4MoeForCausalLM``): a Llama-style attention with a partial rotary (q/k/v biases and per-head
q/k norms when the config asks), and DeepSeek-V3's mixture of experts: the first ``first_k_dense_replace``
layers dense, the rest routed by sigmoid scores with a correction bias and group-limited choice, plus shared
experts."""

from __future__ import annotations

from types import MappingProxyType

from engine.models.config import ModelConfig
from engine.models.deepseek import deepseek_moe_spec, past_last_layer, sparse_after_dense
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import (
    DEEPSEEK_EXPERT_NAMES,
    GLOBAL_NAMES,
    LAYER_NAMES,
    QK_NORM_NAMES,
    extend,
)
from engine.models.layers.spec import DecoderSpec
from engine.models.llama import standard_rope


class Glm4MoeForCausalLM(DenseDecoder):
    """``Glm4MoeForCausalLM``. The multi-token-prediction layers a checkpoint may carry after the last
    decoder layer (``num_nextn_predict_layers``) are for speculative decoding and are not loaded. Loads
    llama.cpp's ``glm4moe`` files (GLM-4.5 / 4.6 / Air), whose last blocks are those layers."""

    gguf_architectures = MappingProxyType({"glm4moe": "Glm4MoeForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = extend(
        extend(extend(LAYER_NAMES, QK_NORM_NAMES), DEEPSEEK_EXPERT_NAMES),
        {"post_attention_norm.weight": "post_attention_layernorm.weight"},
        drop=("ffn_norm.weight",),
    )

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Dense first layers, then sigmoid-routed experts with shared ones."""
        return DecoderSpec(
            layers=sparse_after_dense(config),
            ropes=(standard_rope(config),),
            qk_norm="head" if config.hf_config.get("use_qk_norm") else "none",
            qkv_bias=config.attention_bias,
            moe=deepseek_moe_spec(config.hf_config),
        )

    @classmethod
    def ignores_weight(cls, name: str, config: ModelConfig) -> bool:
        """Also the multi-token-prediction layers past ``num_hidden_layers``."""
        return super().ignores_weight(name, config) or past_last_layer(name, config)

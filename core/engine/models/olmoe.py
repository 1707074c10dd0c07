"""OLMoE: pre-norm layers with OLMo's full-width q/k RMSNorm, every MLP a mixture of experts (softmax
top-k, not renormalised unless ``norm_topk_prob``)."""

from __future__ import annotations

from types import MappingProxyType

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import EXPERT_NAMES, GLOBAL_NAMES, LAYER_NAMES, QK_NORM_NAMES, extend
from engine.models.layers.spec import DecoderSpec, LayerSpec, MoeSpec
from engine.models.llama import standard_rope
from engine.models.qwen_moe import num_experts


class OlmoeForCausalLM(DenseDecoder):
    """``OlmoeForCausalLM``: ``num_experts`` experts of ``intermediate_size`` per layer under ``mlp``.

    Raises:
        ValueError: for ``clip_qkv`` (clamped q/k/v activations), which the engine does not apply.
    """

    gguf_architectures = MappingProxyType({"olmoe": "OlmoeForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = extend(extend(LAYER_NAMES, QK_NORM_NAMES), EXPERT_NAMES)

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Pre-norm layers, full-width q/k RMSNorm, a mixture of experts in every layer."""
        hf = config.hf_config
        if hf.get("clip_qkv") is not None:
            raise ValueError("OLMoE's clip_qkv (clamped q/k/v) is not supported")
        moe = MoeSpec(
            num_experts=num_experts(hf),
            top_k=int(hf["num_experts_per_tok"]),
            renormalize=bool(hf.get("norm_topk_prob", False)),
            intermediate_size=config.intermediate_size,
        )
        return DecoderSpec(
            layers=tuple(LayerSpec(moe=True) for _ in range(config.num_layers)),
            ropes=(standard_rope(config),),
            qk_norm="full",
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            moe=moe,
        )

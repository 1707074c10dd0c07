"""GLM-4.5 (``Glm4MoeForCausalLM``): a Llama-style attention with a partial rotary (q/k/v biases and per-head
q/k norms when the config asks), the first ``first_k_dense_replace`` layers dense, the rest mixtures of
experts routed by sigmoid scores with a correction bias and group-limited choice, plus shared experts."""

from __future__ import annotations

import re

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.spec import DecoderSpec, LayerSpec, MoeSpec
from engine.models.llama import standard_rope
from engine.models.qwen_moe import num_experts

#: a layer index in a checkpoint name
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeForCausalLM(DenseDecoder):
    """``Glm4MoeForCausalLM``. The multi-token-prediction layers a checkpoint may carry after the last
    decoder layer (``num_nextn_predict_layers``) are for speculative decoding and are not loaded."""

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Dense first layers, then sigmoid-routed experts with shared ones."""
        hf = config.hf_config
        first_sparse = int(hf.get("first_k_dense_replace", 0))
        shared = int(hf.get("n_shared_experts", 0) or 0)
        moe = MoeSpec(
            num_experts=int(hf.get("n_routed_experts") or num_experts(hf)),
            top_k=int(hf["num_experts_per_tok"]),
            renormalize=bool(hf.get("norm_topk_prob", True)),
            intermediate_size=int(hf["moe_intermediate_size"]),
            shared_intermediate_size=int(hf["moe_intermediate_size"]) * shared if shared else None,
            shared_expert="mlp.shared_experts.",
            scoring="sigmoid",
            correction_bias="mlp.gate.e_score_correction_bias",
            num_groups=int(hf.get("n_group", 1) or 1),
            topk_groups=int(hf.get("topk_group", 1) or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        )
        return DecoderSpec(
            layers=tuple(LayerSpec(moe=i >= first_sparse) for i in range(config.num_layers)),
            ropes=(standard_rope(config),),
            qk_norm="head" if hf.get("use_qk_norm") else "none",
            qkv_bias=config.attention_bias,
            moe=moe,
        )

    @classmethod
    def ignores_weight(cls, name: str, config: ModelConfig) -> bool:
        """Also the multi-token-prediction layers past ``num_hidden_layers``."""
        match = _LAYER.match(name)
        return super().ignores_weight(name, config) or (match is not None and int(match.group(1)) >= config.num_layers)

"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, also R1) and DeepSeek-V2 (``DeepseekV2ForCausalLM``, V2-Lite):
multi-head latent attention, the first ``first_k_dense_replace`` layers dense, the rest mixtures of experts
plus shared experts. V3 routes by sigmoid scores with a correction bias and group-limited choice (GLM-4.5
shares that layout, :func:`deepseek_moe_spec`); V2 by softmax scores, greedily or group-limited by each
group's best expert."""

from __future__ import annotations

import dataclasses
import re
from types import MappingProxyType
from typing import Any

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import DEEPSEEK_EXPERT_NAMES, GLOBAL_NAMES, LAYER_NAMES, extend
from engine.models.layers.hf_config import rope_parameters
from engine.models.layers.spec import DecoderSpec, LayerSpec, MlaSpec, MoeSpec
from engine.models.llama import standard_rope
from engine.models.qwen_moe import num_experts
from engine.models.rotary import yarn_mscale

#: a layer index in a checkpoint name
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def deepseek_moe_spec(hf: dict[str, Any]) -> MoeSpec:
    """DeepSeek-V3's experts as its config (and GLM-4.5's) spell them."""
    shared = int(hf.get("n_shared_experts", 0) or 0)
    return MoeSpec(
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


def sparse_after_dense(config: ModelConfig) -> tuple[LayerSpec, ...]:
    """Dense layers up to ``first_k_dense_replace``, then a mixture of experts every ``moe_layer_freq``."""
    hf = config.hf_config
    first, every = int(hf.get("first_k_dense_replace", 0)), int(hf.get("moe_layer_freq", 1) or 1)
    return tuple(LayerSpec(moe=i >= first and i % every == 0) for i in range(config.num_layers))


def past_last_layer(name: str, config: ModelConfig) -> bool:
    """Whether ``name`` belongs to a layer past ``num_hidden_layers``: the multi-token-prediction layers a
    checkpoint may carry for speculative decoding (``num_nextn_predict_layers``), which are not loaded."""
    match = _LAYER.match(name)
    return match is not None and int(match.group(1)) >= config.num_layers


class DeepseekV3ForCausalLM(DenseDecoder):
    """``DeepseekV3ForCausalLM``: latent attention (the cache holds one latent row per token), DeepSeek's
    experts. Its multi-token-prediction layers are skipped.

    Loads llama.cpp's ``deepseek2`` files too (V2 ones as :class:`DeepseekV2ForCausalLM`), with the latent
    up-projection as one ``attn_kv_b`` or, from newer converters, split into ``attn_k_b`` / ``attn_v_b``.
    """

    gguf_architectures = MappingProxyType({"deepseek2": "DeepseekV3ForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = extend(
        extend(LAYER_NAMES, DEEPSEEK_EXPERT_NAMES),
        {
            "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
            "attn_q_b.weight": "self_attn.q_b_proj.weight",
            "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
            "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
            "attn_k_b.weight": "self_attn.k_b_proj.weight", "attn_v_b.weight": "self_attn.v_b_proj.weight",
        },
    )  # fmt: skip

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Latent attention with a rotary key of ``qk_rope_head_dim``; dense first layers, then experts."""
        hf = config.hf_config
        mla = mla_spec(hf)
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        rope = dataclasses.replace(standard_rope(config), rotary_dim=mla.qk_rope_head_dim, interleaved=False)
        return DecoderSpec(
            layers=sparse_after_dense(config),
            ropes=(rope,),
            scale=qk_head_dim**-0.5 * softmax_mscale(hf) ** 2,
            moe=deepseek_moe_spec(hf),
            mla=mla,
        )

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """Attention runs over one KV head of ``kv_lora_rank + qk_rope_head_dim`` (the latent rows).

        Raises:
            ValueError: for ``attention_bias`` (no DeepSeek checkpoint has it; not loaded here).
        """
        if hf_config.get("attention_bias"):
            raise ValueError(f"{hf_config['architectures'][0]} with attention_bias is not supported")
        config = super().config_from_hf(hf_config)
        config.head_dim = int(hf_config["kv_lora_rank"]) + int(hf_config["qk_rope_head_dim"])
        config.num_kv_heads = 1
        return config

    @classmethod
    def ignores_weight(cls, name: str, config: ModelConfig) -> bool:
        """Also the multi-token-prediction layers."""
        return super().ignores_weight(name, config) or past_last_layer(name, config)


def mla_spec(hf: dict[str, Any]) -> MlaSpec:
    """The latent attention's widths from a DeepSeek config."""
    q_lora = hf.get("q_lora_rank")
    return MlaSpec(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        interleaved_rope=bool(hf.get("rope_interleave", True)),
        split_kv_b=bool(hf.get("split_kv_b", False)),
    )


def softmax_mscale(hf: dict[str, Any]) -> float:
    """YaRN's ``mscale`` on the softmax scale (DeepSeek squares it): 1 without YaRN or ``mscale_all_dim``."""
    params = rope_parameters(hf)
    mscale_all_dim = float(params.get("mscale_all_dim", 0) or 0)
    if params.get("rope_type", params.get("type")) != "yarn" or not mscale_all_dim:
        return 1.0
    return yarn_mscale(float(params["factor"]), mscale_all_dim)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """``DeepseekV2ForCausalLM``: V3's latent attention (usually one ``q_proj``, no compressed query) and
    experts routed by softmax: ``topk_method`` ``greedy`` (the best ``top_k``) or ``group_limited_greedy``
    (within the ``topk_group`` groups whose best expert scores highest); weights not renormalised, times
    ``routed_scaling_factor``."""

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """V3's spec with V2's routing."""
        hf = config.hf_config
        spec = super().decoder_spec(config)
        assert spec.moe is not None
        grouped = hf.get("topk_method", "greedy") == "group_limited_greedy"
        moe = dataclasses.replace(
            spec.moe, scoring="softmax", correction_bias=None, renormalize=False, group_score="max",
            num_groups=spec.moe.num_groups if grouped else 1, topk_groups=spec.moe.topk_groups if grouped else 1,
        )  # fmt: skip
        return dataclasses.replace(spec, moe=moe)

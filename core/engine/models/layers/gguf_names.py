"""llama.cpp's tensor names for the shared decoder blocks, and its Q/K row order of the ``llama`` lineage.

llama.cpp names tensors by role, not by architecture: ``blk.<i>.attn_q.weight`` is the query projection
of every kind. The tables here are the Llama layout; an architecture file extends them with its extra
tensors (q/k norms, sandwich norms, fused projections) through :func:`extend`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from engine.models.config import ModelConfig

#: llama.cpp's global tensor names -> HF names
GLOBAL_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)

#: llama.cpp's per-layer names (after ``blk.<i>.``) -> HF names (after the layer prefix), Llama layout
LAYER_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.weight": "self_attn.o_proj.weight",
        "attn_output.bias": "self_attn.o_proj.bias",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
)

#: the per-head q/k norms (Qwen3, Gemma3, OLMo2, Cohere, StableLM)
QK_NORM_NAMES: Mapping[str, str] = MappingProxyType(
    {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
)


def extend(base: Mapping[str, str], extra: Mapping[str, str], drop: tuple[str, ...] = ()) -> Mapping[str, str]:
    """A read-only name table: ``base`` without ``drop``, then ``extra`` (which wins on a clash).

    Args:
        base: a name table such as :data:`LAYER_NAMES`.
        extra: names to add or remap.
        drop: llama.cpp names the architecture never stores.

    Returns:
        The merged table.
    """
    merged = {k: v for k, v in base.items() if k not in drop}
    merged.update(extra)
    return MappingProxyType(merged)


def llama_permuted_heads(name: str, config: ModelConfig) -> int:
    """The heads llama.cpp's ``llama``-lineage converters (llama, granite, smollm3) permuted Q/K rows in.

    Those converters interleave the two rotary halves of each head of ``q_proj`` and ``k_proj`` (weights
    and biases) for llama.cpp's adjacent-pair rotary.

    Args:
        name: the tensor's HF name.
        config: the model config.

    Returns:
        Query heads for Q, KV heads for K, else 0.
    """
    if ".q_proj." in name:
        return config.num_heads
    return config.num_kv_heads if ".k_proj." in name else 0


#: llama.cpp's stacked-expert tensors (``[experts, out, in]``) and router of a mixture of experts under
#: ``mlp`` (Qwen-MoE, OLMoE): ``{}`` is the expert's index, which the loader fills in for each expert
EXPERT_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight",
        "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
        "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight",
        # converters' --fuse-gate-up-exps: the gate's rows then the up projection's, cut apart at load
        "ffn_gate_up_exps.weight": "mlp.experts.{}.gate_proj.weight+mlp.experts.{}.up_proj.weight",
    }
)

#: Qwen2-MoE's shared expert and its sigmoid gate
SHARED_EXPERT_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
        "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    }
)

#: DeepSeek's experts as llama.cpp names them (DeepSeek-V2/V3, GLM-4.5): the routed ones, the router's
#: correction bias and the shared experts under ``mlp.shared_experts``
DEEPSEEK_EXPERT_NAMES: Mapping[str, str] = MappingProxyType(
    {
        **EXPERT_NAMES,
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        **{f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")},
    }
)

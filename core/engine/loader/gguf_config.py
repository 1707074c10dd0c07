"""GGUF metadata as a Hugging Face ``config.json`` dict: one table entry per llama.cpp architecture.

llama.cpp's converters write the HF config as ``<arch>.<key>`` metadata (names in gguf-py's
``Keys``); a few values its runtime assumes per architecture rather than reads. :data:`GGUF_KINDS` maps
both back to the keys the model classes read, so a GGUF file goes through the same
``config_from_hf`` as the HF checkpoint it was converted from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
from gguf.quants import dequantize

from engine.loader.errors import ModelLoadError
from engine.loader.gguf_reader import GgufField, GgufFile, GgufTensor

#: metadata every kind writes (``<arch>.`` + key) -> HF key
COMMON_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "context_length": "max_position_embeddings",
        "embedding_length": "hidden_size",
        "feed_forward_length": "intermediate_size",
        "block_count": "num_hidden_layers",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "attention.key_length": "head_dim",
        "attention.layer_norm_rms_epsilon": "rms_norm_eps",
        "rope.freq_base": "rope_theta",
        "attention.sliding_window": "sliding_window",
        "expert_count": "num_experts",
        "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    }
)
#: the common keys a file must have
REQUIRED_KEYS = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count")
#: HF values for common keys a file leaves out
COMMON_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
)

Derive = Callable[[dict[str, Any], Mapping[str, GgufTensor]], None]


@dataclass(frozen=True, slots=True)
class GgufKind:
    """How the metadata of one llama.cpp architecture reads as HF config keys.

    Attributes:
        keys: ``<arch>.<key>`` -> HF key, beyond :data:`COMMON_KEYS`.
        fixed: HF values llama.cpp's runtime assumes for the kind instead of reading them (a key in
            ``keys`` that the file has overrides one).
        tensor_flags: HF boolean key -> a GGUF tensor whose presence sets it (optional q/k norms, biases).
        partial_rotary: ``rope.dimension_count`` is the rotated part of each head, i.e. HF's
            ``partial_rotary_factor`` times ``head_dim``.
        derive: sets keys computed from the others or from tensors, or None.
    """

    keys: Mapping[str, str] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    tensor_flags: Mapping[str, str] = field(default_factory=dict)
    partial_rotary: bool = False
    derive: Derive | None = None


def gemma_attention_scalar(layers_of_27b: int) -> Derive:
    """llama.cpp's ``query_pre_attn_scalar`` for Gemma 2/3, which the converter does not write: the head
    size, except ``hidden / heads`` for the 27B model (recognised by its layer count)."""

    def derive(hf: dict[str, Any], tensors: Mapping[str, GgufTensor]) -> None:
        if int(hf["num_hidden_layers"]) == layers_of_27b:
            hf["query_pre_attn_scalar"] = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
        else:
            hf["query_pre_attn_scalar"] = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))

    return derive


def phi3_longrope(hf: dict[str, Any], tensors: Mapping[str, GgufTensor]) -> None:
    """Phi-3's ``longrope`` factors travel as the ``rope_factors_long/short`` tensors."""
    if "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        hf["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": factor_list(tensors["rope_factors_long.weight"]),
            "short_factor": factor_list(tensors["rope_factors_short.weight"]),
        }


def stablelm_residual(hf: dict[str, Any], tensors: Mapping[str, GgufTensor]) -> None:
    """llama.cpp runs StableLM's layers in parallel exactly when they have no ``ffn_norm``."""
    hf["use_parallel_residual"] = "blk.0.ffn_norm.weight" not in tensors


def factor_list(tensor: GgufTensor) -> list[float]:
    """A 1-D tensor's values as floats."""
    return [float(v) for v in np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)]


def gpt_oss_yarn(hf: dict[str, Any], tensors: Mapping[str, GgufTensor]) -> None:
    """gpt-oss's YaRN keeps its correction range unrounded (HF's ``truncate: false``), which the converter
    does not write."""
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "yarn":
        scaling.setdefault("beta_fast", 32.0)
        scaling.setdefault("beta_slow", 1.0)
        scaling["truncate"] = False


def deepseek2(hf: dict[str, Any], tensors: Mapping[str, GgufTensor]) -> None:
    """llama.cpp's ``deepseek2`` files as the HF config: attention is written as one KV head of the latent
    (HF counts the query heads), the key's non-rotary part is ``key_length_mla`` less the rotary part, newer
    converters split ``kv_b_proj`` (``split_kv_b``, the engine's own key), YaRN's
    ``mscale_all_dim`` travels as a tenth of it (``yarn_log_multiplier``), and sigmoid routing with a
    correction bias is V3 (R1), softmax V2."""
    hf["num_key_value_heads"] = hf["num_attention_heads"]
    rope = int(hf["qk_rope_head_dim"])
    hf["qk_nope_head_dim"] = int(hf.pop("key_length_mla")) - rope
    hf["head_dim"] = rope
    # newer converters split the latent up-projection (MLA's MlaSpec.split_kv_b)
    hf["split_kv_b"] = any(name.endswith("attn_k_b.weight") for name in tensors)
    log_multiplier = hf.pop("yarn_log_multiplier", None)
    if log_multiplier is not None and hf.get("rope_scaling"):
        hf["rope_scaling"]["mscale"] = hf["rope_scaling"]["mscale_all_dim"] = float(log_multiplier) / 0.1
    sigmoid = int(hf.pop("expert_gating_func", 1)) == 2 or any(name.endswith("exp_probs_b.bias") for name in tensors)
    if not sigmoid:
        hf["architectures"] = ["DeepseekV2ForCausalLM"]
        if int(hf.get("n_group", 1)) > 1:
            hf["topk_method"] = "group_limited_greedy"
    hf.setdefault("norm_topk_prob", False)


def glm4moe_layers(hf: dict[str, Any], tensors: Mapping[str, GgufTensor]) -> None:
    """The converter counts GLM-4.5's multi-token-prediction layers in ``block_count``; HF does not."""
    hf["num_hidden_layers"] = int(hf["num_hidden_layers"]) - int(hf.get("num_nextn_predict_layers", 0) or 0)


_LAYER_NORM_EPS = {"attention.layer_norm_epsilon": "layer_norm_eps"}
#: DeepSeek-style experts' keys (deepseek2, glm4moe)
_DEEPSEEK_EXPERT_KEYS: Mapping[str, str] = MappingProxyType({
    "leading_dense_block_count": "first_k_dense_replace", "expert_count": "n_routed_experts",
    "expert_shared_count": "n_shared_experts", "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob", "expert_group_count": "n_group", "expert_group_used_count": "topk_group",
})  # fmt: skip

#: llama.cpp architecture -> how its metadata reads; a kind not listed gets the common keys only
GGUF_KINDS: Mapping[str, GgufKind] = MappingProxyType(
    {
        # a llama file with experts is Mixtral, which spells the count num_local_experts
        "llama": GgufKind(keys={"expert_count": "num_local_experts"}),
        "qwen2": GgufKind(),
        "qwen3": GgufKind(),
        # llama.cpp renormalises Qwen3-MoE's top-k weights and not Qwen2-MoE's (it reads no key for it), and
        # runs every layer as a mixture of experts
        "qwen2moe": GgufKind(fixed={"norm_topk_prob": False}),
        "qwen3moe": GgufKind(fixed={"norm_topk_prob": True}),
        "olmoe": GgufKind(fixed={"norm_topk_prob": False}),
        "deepseek2": GgufKind(
            keys={
                "attention.q_lora_rank": "q_lora_rank", "attention.kv_lora_rank": "kv_lora_rank",
                "attention.key_length_mla": "key_length_mla", "attention.value_length_mla": "v_head_dim",
                "rope.dimension_count": "qk_rope_head_dim", **_DEEPSEEK_EXPERT_KEYS,
                "expert_gating_func": "expert_gating_func", "rope.scaling.yarn_log_multiplier": "yarn_log_multiplier",
            },
            derive=deepseek2,
        ),  # fmt: skip
        "glm4moe": GgufKind(
            keys={**_DEEPSEEK_EXPERT_KEYS, "nextn_predict_layers": "num_nextn_predict_layers"},
            tensor_flags={"use_qk_norm": "blk.0.attn_q_norm.weight"},
            partial_rotary=True,
            derive=glm4moe_layers,
        ),
        # experts a tensor per projection (gate and up apart), not transformers' interleaved stack
        "gpt-oss": GgufKind(
            keys={"expert_count": "num_local_experts"}, fixed={"expert_layout": "per_expert"}, derive=gpt_oss_yarn,
        ),
        "gemma2": GgufKind(
            keys={"attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping"},
            derive=gemma_attention_scalar(46),
        ),
        # llama.cpp: every 6th layer global, local layers on a fixed 10000 base unless the file says
        "gemma3": GgufKind(
            keys={"final_logit_softcapping": "final_logit_softcapping", "rope.freq_base_swa": "rope_local_base_freq"},
            fixed={"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0},
            derive=gemma_attention_scalar(62),
        ),
        "phi3": GgufKind(
            keys={"rope.scaling.original_context_length": "original_max_position_embeddings"},
            partial_rotary=True,
            derive=phi3_longrope,
        ),
        "olmo2": GgufKind(),
        "granite": GgufKind(
            keys={
                "attention.scale": "attention_multiplier",
                "embedding_scale": "embedding_multiplier",
                "residual_scale": "residual_multiplier",
                "logit_scale": "logits_scaling",
            }
        ),
        "glm4": GgufKind(partial_rotary=True),
        "stablelm": GgufKind(
            keys=_LAYER_NORM_EPS,
            tensor_flags={"use_qkv_bias": "blk.0.attn_q.bias", "qk_layernorm": "blk.0.attn_q_norm.weight"},
            partial_rotary=True,
            derive=stablelm_residual,
        ),
        "command-r": GgufKind(
            keys={**_LAYER_NORM_EPS, "logit_scale": "logit_scale"},
            tensor_flags={"use_qk_norm": "blk.0.attn_q_norm.weight"},
        ),
        # llama.cpp's smollm3 drops the rotary of every 4th layer: SmolLM3's default no_rope_layers
        "smollm3": GgufKind(),
    }
)


def field_value(field_: GgufField) -> str | int | float | bool:
    """The value of a scalar or string metadata field.

    Args:
        field_: the field, as :class:`GgufFile` read it.

    Returns:
        Its decoded value.

    Raises:
        ModelLoadError: the field is an array.
    """
    if field_.is_array or field_.value is None:
        raise ModelLoadError(f"GGUF field '{field_.name}' is an array, expected a single value")
    return field_.value


def rope_scaling(reader: GgufFile, arch: str, max_positions: int) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``rope.scaling.*`` (``linear`` and ``yarn``; llama.cpp's other types travel
    as tensors or are not scalings), None without one."""

    def get(key: str) -> Any:
        found = reader.fields.get(f"{arch}.rope.scaling.{key}")
        return None if found is None else field_value(found)

    kind = get("type")
    if kind == "linear" and get("factor") is not None:
        return {"rope_type": "linear", "factor": float(get("factor"))}
    if kind == "yarn" and get("factor") is not None:
        scaling: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": float(get("factor")),
            "original_max_position_embeddings": int(get("original_context_length") or max_positions),
        }
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"), ("yarn_attn_factor", "attention_factor")):
            if get(gguf_key) is not None:
                scaling[hf_key] = float(get(gguf_key))
        return scaling
    return None


def gguf_hf_config(reader: GgufFile, arch: str, hf_arch: str, path: str) -> dict[str, Any]:
    """The HF config dict a GGUF file's metadata and tensors stand for.

    Args:
        reader: the open file.
        arch: its ``general.architecture``.
        hf_arch: the HF architecture name it loads as.
        path: the file, for messages.

    Returns:
        A ``config.json``-style dict (``architectures``, sizes, rotary, special tokens, the kind's own keys);
        ``vocab_size`` is the embedding's row count, ``torch_dtype`` float32 (tensors are dequantised).

    Raises:
        ModelLoadError: a required key or the token embedding is missing.
    """
    kind = GGUF_KINDS.get(arch, GgufKind())
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"GGUF file {path} has no 'token_embd.weight' tensor")
    for key in REQUIRED_KEYS:
        if f"{arch}.{key}" not in reader.fields:
            raise ModelLoadError(f"GGUF file {path} lacks metadata '{arch}.{key}'")
    # ggml lists dimensions innermost first: the embedding's row count is the last one (it may pad past the
    # token list, so the list's length is not the vocabulary size)
    hf: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        **COMMON_DEFAULTS,
        **kind.fixed,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": "float32",
    }
    for gguf_key, hf_key in {**COMMON_KEYS, **kind.keys}.items():
        found = reader.fields.get(f"{arch}.{gguf_key}")
        if found is not None:
            hf[hf_key] = field_value(found)
    for hf_key, tensor_name in kind.tensor_flags.items():
        hf[hf_key] = tensor_name in tensors
    if kind.partial_rotary and f"{arch}.rope.dimension_count" in reader.fields:
        head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
        hf["partial_rotary_factor"] = int(field_value(reader.fields[f"{arch}.rope.dimension_count"])) / head_dim
    scaling = rope_scaling(reader, arch, int(hf["max_position_embeddings"]))
    if scaling is not None:
        hf["rope_scaling"] = scaling
    if not hf.get("sliding_window"):
        hf.pop("sliding_window", None)  # Phi-3's converter writes 0 for "none"
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in reader.fields and int(field_value(reader.fields[key])) not in eos_ids:
            eos_ids.append(int(field_value(reader.fields[key])))
    if eos_ids:
        hf["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    if "tokenizer.ggml.bos_token_id" in reader.fields:
        hf["bos_token_id"] = int(field_value(reader.fields["tokenizer.ggml.bos_token_id"]))
    if kind.derive is not None:
        kind.derive(hf, tensors)
    return hf

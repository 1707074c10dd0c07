"""GGUF files of llama.cpp's architectures beyond ``llama``/``qwen2``, written as its converter would.

Each kind: a tiny seeded HF model, written to GGUF by :func:`write_gguf` (gguf-py's own tensor-name map,
the converter's metadata keys and value transforms); transformers reads the file back where it knows the
kind (a check of the writer, independent of the engine), and the engine, loading the file, matches the
HF model's prefill logits and greedy tokens in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from dense_model_utils import PROMPTS, engine_prefill_logits, hf_greedy, load_hf, max_logit_diff, save_tiny
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine import LLM, SamplingParams
from engine.loader import load_model_config
from engine_plugin_cpu.amx_kernels import AmxWeight
from engine_test_utils import assert_all_blocks_free

WINDOW = 8
#: tiny sizes (head size 32: the smallest the CPU plugin runs)
SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
F32, F16, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0

#: case -> (llama.cpp kind, HF architecture, config overrides, type of the matrices)
CASES: dict[str, tuple[str, str, dict[str, Any], GGMLQuantizationType]] = {
    "llama": ("llama", "LlamaForCausalLM", dict(attention_bias=True), F16),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", dict(), Q8_0),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
    ), F32),
    # six layers: the sixth is Gemma3's global layer, on the linearly scaled base
    "gemma3": ("gemma3", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=32,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
    ), F32),
    "phi3": ("phi3", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5, sliding_window=WINDOW, pad_token_id=0), F32),
    "olmo2": ("olmo2", "Olmo2ForCausalLM", dict(), F32),
    "granite": ("granite", "GraniteForCausalLM", dict(
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.05, logits_scaling=2.0,
    ), F32),
    "glm4": ("glm4", "Glm4ForCausalLM", dict(pad_token_id=0), F32),
    "stablelm": ("stablelm", "StableLmForCausalLM", dict(use_qkv_bias=True, qk_layernorm=True), F32),
    "command-r": ("command-r", "CohereForCausalLM", dict(use_qk_norm=True, logit_scale=0.5), F32),
    # four layers: llama.cpp's smollm3 drops the rotary of every 4th
    "smollm3": ("smollm3", "SmolLM3ForCausalLM", dict(num_hidden_layers=4, pad_token_id=0), F32),
    # mixtures of experts (4 experts, 2 a token), stacked per projection as ggml [in, out, experts]; Mixtral
    # is a llama file with experts; Qwen2-MoE's shared expert gated
    "mixtral": ("llama", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64), Q8_0),
    "qwen2moe": ("qwen2moe", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
        norm_topk_prob=False,
    ), Q8_0),
    "qwen3moe": ("qwen3moe", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
    ), Q8_0),
    "olmoe": ("olmoe", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64), F16),
    # gpt-oss: sinks, a sliding first layer, biased router and experts (transformers' interleaved gate/up
    # stack, which the converter splits), YaRN; matrices in MXFP4 as the released GGUFs' experts
    "gpt-oss": ("gpt-oss", "GptOssForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0,
        },
    ), GGMLQuantizationType.MXFP4),
    # DeepSeek-V3 (R1): latent attention with a compressed query, its up-projection split into attn_k_b /
    # attn_v_b as newer converters write it; a dense first layer, sigmoid routing with a correction bias
    # over 2 groups, a shared expert
    "deepseek2": ("deepseek2", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, intermediate_size=64,
        q_lora_rank=64, kv_lora_rank=56, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, head_dim=8,
        num_attention_heads=4, num_key_value_heads=4,
    ), Q8_0),
    # GLM-4.5: a dense first layer, sigmoid routing with a correction bias, a shared expert, q/k norms and
    # biases, half of each head rotated; its multi-token-prediction layer written as a last block
    "glm4moe": ("glm4moe", "Glm4MoeForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, intermediate_size=64,
        use_qk_norm=True, attention_bias=True, pad_token_id=0, num_nextn_predict_layers=1,
    ), Q8_0),
    # DeepSeek-V2: one q_proj, softmax routing within 2 of 4 groups, the up-projection as one attn_kv_b
    "deepseek2-v2": ("deepseek2", "DeepseekV2ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5, intermediate_size=64, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=16,
        qk_rope_head_dim=64, v_head_dim=24, head_dim=64, num_attention_heads=4, num_key_value_heads=4,
    ), F16),
}
#: the kinds transformers' GGUF loader reads
TRANSFORMERS_KINDS = {"llama", "qwen3", "gemma2", "gemma3", "phi3", "stablelm"}
#: converters derived from llama.cpp's LlamaModel interleave the rotary halves of Q/K rows per head
PERMUTED_KINDS = {"llama", "granite", "smollm3"}
#: Gemma's converters store norm scales as 1 + w
PLUS_ONE_KINDS = {"gemma2", "gemma3"}


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's two rotary halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def roundtrip(array: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(the stored data, what it dequantises to) of a float32 array in ``qtype``."""
    if qtype == F32:
        return array, array
    data = array.astype(np.float16) if qtype == F16 else quantize(array, qtype)
    return data, dequantize(data, qtype).reshape(array.shape).astype(np.float32)


def write_metadata(writer: gguf.GGUFWriter, kind: str, cfg: Any) -> None:
    """The keys llama.cpp's converter writes for ``kind`` (``convert_hf_to_gguf``'s set_gguf_parameters)."""
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    head_dim = cfg.hidden_size // cfg.num_attention_heads if kind == "granite" else cfg.head_dim
    # GLM-4.5's converter counts its multi-token-prediction layers as blocks
    writer.add_block_count(cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if kind == "glm4moe" else 0))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    # deepseek2's converter writes latent attention as one KV head of the latent
    writer.add_head_count_kv(1 if kind == "deepseek2" else cfg.num_key_value_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    if kind in ("stablelm", "command-r"):
        writer.add_layer_norm_eps(cfg.layer_norm_eps)
    else:
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if kind not in ("granite", "deepseek2"):  # the granite converter drops head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    extra: dict[str, Callable[[], None]] = {
        "gemma2": lambda: (
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping),
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping),
            writer.add_sliding_window(cfg.sliding_window),
        ),
        "gemma3": lambda: writer.add_sliding_window(cfg.sliding_window),
        "phi3": lambda: (
            writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads),
            writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings),
            writer.add_sliding_window(cfg.sliding_window or 0),
        ),
        "granite": lambda: (
            writer.add_attention_scale(cfg.attention_multiplier),
            writer.add_embedding_scale(cfg.embedding_multiplier),
            writer.add_residual_scale(cfg.residual_multiplier),
            writer.add_logit_scale(cfg.logits_scaling),
        ),
        "glm4": lambda: writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"])),
        "stablelm": lambda: (
            writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim)),
            writer.add_parallel_residual(cfg.use_parallel_residual),
        ),
        "command-r": lambda: writer.add_logit_scale(cfg.logit_scale),
        "gpt-oss": lambda: (
            writer.add_sliding_window(cfg.sliding_window),
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN),
            writer.add_rope_scaling_factor(rope["factor"]),
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"]),
        ),
        "deepseek2": lambda: write_deepseek2_metadata(writer, cfg),
        "glm4moe": lambda: (
            writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"])),
            write_deepseek_experts(writer, cfg, sigmoid=True),
            writer.add_nextn_predict_layers(cfg.num_nextn_predict_layers),
        ),
    }
    if kind in PERMUTED_KINDS:
        writer.add_rope_dimension_count(head_dim)
    extra.get(kind, lambda: None)()
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts and kind not in ("deepseek2", "glm4moe"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    # no token list (the engine takes the HF tokenizer folder, and 49152 strings make every open slow), so
    # the vocabulary size transformers would count from it is written as the llama converter writes it
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)


def write_deepseek2_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """The deepseek2 converter's keys: latent widths (the key as the latent plus its rotary part), the dense
    layers, the experts and their routing."""
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    write_deepseek_experts(writer, cfg, sigmoid=cfg.architectures[0] == "DeepseekV3ForCausalLM")


def write_deepseek_experts(writer: gguf.GGUFWriter, cfg: Any, sigmoid: bool) -> None:
    """DeepSeek-style experts' keys (deepseek2, glm4moe): dense first layers, routed and shared experts, the
    routing's function, scale, renormalisation and groups."""
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if sigmoid and cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)


def write_gguf(
    path: Path, kind: str, model: torch.nn.Module, qtype: GGMLQuantizationType, stacked: bool = True,
    fused_gate_up: bool = False,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Write ``model`` as llama.cpp's converter would, matrices in ``qtype``; experts stacked per projection,
    or (``stacked=False``) one tensor each as converters wrote Mixtral before 2024; ``fused_gate_up``: gate and
    up in one stack (``ffn_gate_up_exps``, the converter's ``--fuse-gate-up-exps``).

    Returns:
        The HF state the file holds (the model's tensors after the ``qtype`` round trip).
    """
    cfg = model.config
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == kind), cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), kind)
    write_metadata(writer, kind, cfg)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    expected: dict[str, torch.Tensor] = {}
    norm_stacks: dict[str, list[np.ndarray]] = {}
    for name, array in state.items():
        if name.endswith("e_score_correction_bias"):
            writer.add_tensor(names.get_name(name.split(".mlp.")[0] + ".mlp.gate", try_suffixes=()).replace("ffn_gate_inp", "exp_probs_b") + ".bias", array)
            expected[name] = torch.from_numpy(array)
            continue
        if kind == "deepseek2" and name.endswith("kv_b_proj.weight") and qtype != F16:
            # newer converters: [heads, nope + v, latent] split, the key part transposed to [heads, latent, nope]
            heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
            kv_b = array.reshape(heads, nope + cfg.v_head_dim, -1)
            stem = names.get_name(name, try_suffixes=(".weight",)).removesuffix("_kv_b.weight")
            writer.add_tensor(stem + "_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
            writer.add_tensor(stem + "_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
            expected[name] = torch.from_numpy(array)
            continue
        if kind == "gpt-oss" and ".mlp.experts." in name:
            expected[name] = torch.from_numpy(add_gpt_oss_experts(writer, names, name, array, qtype))
            continue
        # routers stay float, as llama.cpp's quantizer leaves them
        routing = name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "mlp.router.weight"))
        data, back = roundtrip(array, qtype if array.ndim >= 2 and "norm" not in name and not routing else F32)
        expected[name] = torch.from_numpy(np.ascontiguousarray(back))
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' [experts, gate rows then up rows, in]
            layer = name.split(".mlp.")[0] + ".mlp.experts."
            if fused_gate_up:
                stem = names.get_name(layer + "gate_proj", try_suffixes=()).removesuffix("_gate_exps")
                writer.add_tensor(stem + "_gate_up_exps.weight", np.ascontiguousarray(data), raw_dtype=qtype if data.dtype != np.float32 else F32)
                continue
            gate, up = np.split(data, 2, axis=1)
            for part, projection in ((gate, "gate_proj"), (up, "up_proj")):
                add_experts(writer, names.get_name(layer + projection, try_suffixes=()), part, qtype, stacked)
            continue
        if name.endswith("mlp.experts.down_proj"):
            add_experts(writer, names.get_name(name, try_suffixes=()), data, qtype, stacked)
            continue
        if name.endswith("shared_expert_gate.weight"):  # one row, which the converter may write as a vector
            data = data.reshape(-1)
        if ".norms." in name:  # StableLM's per-head q/k norms: the converter stacks them
            norm_stacks.setdefault(name.split(".norms.")[0] + ".weight", []).append(data)
            continue
        if kind in PERMUTED_KINDS and (".q_proj." in name or ".k_proj." in name):
            data = permute_rows(data, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        if kind in PLUS_ONE_KINDS and name.endswith("norm.weight"):
            data = data + 1.0
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if name.endswith(".sinks"):  # the converter names gpt-oss's sinks as a weight
            gguf_name += ".weight"
        writer.add_tensor(gguf_name, data, raw_dtype=qtype if data.dtype != np.float32 else F32)
    for name, rows in norm_stacks.items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.stack(rows))
    if kind == "glm4moe":  # a few of the multi-token-prediction block's tensors, which the engine skips
        last, gen = f"blk.{cfg.num_hidden_layers}.", np.random.default_rng(1)
        writer.add_tensor(last + "nextn.eh_proj.weight", gen.standard_normal((cfg.hidden_size, 2 * cfg.hidden_size)).astype(np.float32))
        writer.add_tensor(last + "nextn.enorm.weight", np.ones(cfg.hidden_size, dtype=np.float32))
        writer.add_tensor(last + "attn_norm.weight", np.ones(cfg.hidden_size, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def add_experts(writer: gguf.GGUFWriter, stacked_name: str, data: np.ndarray, qtype: GGMLQuantizationType, stacked: bool) -> None:
    """One projection's experts: ``blk.<i>.ffn_<p>_exps.weight``, or ``blk.<i>.ffn_<p>.<e>.weight`` each."""
    raw = qtype if data.dtype != np.float32 else F32
    if stacked:
        writer.add_tensor(stacked_name + ".weight", np.ascontiguousarray(data), raw_dtype=raw)
        return
    for e, expert in enumerate(data):
        writer.add_tensor(f"{stacked_name.removesuffix('_exps')}.{e}.weight", np.ascontiguousarray(expert), raw_dtype=raw)


def add_gpt_oss_experts(writer: gguf.GGUFWriter, names: Any, name: str, array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gpt-oss's experts as its converter writes them: transformers' ``[experts, in, out]`` stacks turned to
    ``[experts, out, in]`` and quantized, the interleaved gate/up outputs (even: gate) split into two stacks,
    the biases likewise. Returns what the file holds, in transformers' layout."""
    stem = names.get_name(name.split(".mlp.experts.")[0] + ".mlp.experts.down_proj", try_suffixes=()).removesuffix("_down_exps")
    if name.endswith("_bias"):
        parts = {"gate": array[:, 0::2], "up": array[:, 1::2]} if "gate_up" in name else {"down": array}
        for projection, bias in parts.items():
            writer.add_tensor(f"{stem}_{projection}_exps.bias", np.ascontiguousarray(bias))
        return array
    data, back = roundtrip(np.ascontiguousarray(array.transpose(0, 2, 1)), qtype)
    parts = {"gate": data[:, 0::2], "up": data[:, 1::2]} if "gate_up" in name else {"down": data}
    for projection, weight in parts.items():
        writer.add_tensor(f"{stem}_{projection}_exps.weight", np.ascontiguousarray(weight), raw_dtype=qtype)
    return np.ascontiguousarray(back.transpose(0, 2, 1))


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, hf_tokenizer_dir):
    kind, arch, overrides, qtype = CASES[request.param]
    folder = save_tiny(arch, str(tmp_path_factory.mktemp(request.param)), hf_tokenizer_dir, seed=3, **{**SIZES, **overrides})
    hf = load_hf(folder)
    path = Path(folder) / f"{request.param}.gguf"
    expected = write_gguf(path, kind, hf, qtype)
    # the HF reference holds exactly what the file holds (F16 / Q8_0 values)
    hf.load_state_dict(expected, strict=not hf.config.tie_word_embeddings)
    return kind, path, hf, expected, hf_tokenizer_dir


def test_transformers_reads_the_written_file(case):
    kind, path, hf, expected, _ = case
    if kind not in TRANSFORMERS_KINDS:
        pytest.skip(f"transformers has no GGUF loader for {kind!r}")
    if hf.config.architectures[0] == "MixtralForCausalLM":
        pytest.skip("transformers reads a llama GGUF with experts as a dense Llama")
    if kind == "qwen3":
        pytest.skip("transformers' qwen3 GGUF mapping drops attention.key_length (head_dim becomes Qwen3Config's 128)")
    pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    state = loaded.state_dict()
    # transformers reads no attention-bias key and does not split StableLM's stacked q/k norms: those
    # tensors stay at its initial values
    missing = sorted(set(expected) - set(state))
    assert all(name.endswith(".bias") or ".norms." in name for name in missing), (kind, missing)
    for name in set(expected) & set(state):
        torch.testing.assert_close(state[name], expected[name], rtol=0, atol=1e-6, msg=f"{kind}: {name}")


def test_engine_loads_the_file_as_hf_runs_the_model(case):
    kind, path, hf, _, tokenizer_dir = case
    config = load_model_config(str(path))
    assert config.architecture == hf.config.architectures[0] and config.num_layers == hf.config.num_hidden_layers
    llm = LLM(model=str(path), tokenizer=tokenizer_dir, device="cpu", dtype="float32", quantization="none",
              kv_cache_memory_bytes=16 << 20)  # fmt: skip
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    assert max(len(t) for t in ids) > WINDOW
    diff = max_logit_diff(llm, hf, ids)
    assert diff < 1e-4, f"{kind}: max |logit - HF| = {diff:.2e}"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:2], outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, llm.tokenizer.encode(prompt), 6), (kind, prompt)
    assert_all_blocks_free(llm)


def test_models_command_lists_the_gguf_kinds(capsys):
    from engine.entrypoints.cli import main

    assert main(["models"]) == 0
    rows = {line.split()[0]: line.split()[2:] for line in capsys.readouterr().out.splitlines()[1:]}
    for kind, arch, _, _ in CASES.values():
        listed = f"{kind}:experts" if arch == "MixtralForCausalLM" else kind
        arch = "DeepseekV3ForCausalLM" if kind == "deepseek2" else arch  # V2 files load through V3's kind
        assert listed in " ".join(rows[arch]).replace(",", " ").split(), (arch, rows[arch])


@pytest.mark.parametrize("qtype", [Q8_0, GGMLQuantizationType.Q4_0])
def test_gguf_experts_stay_quantized(tmp_path, hf_tokenizer_dir, qtype):
    """A Qwen3-MoE file's stacked experts load one expert at a time as GGUF blocks (not dequantised) where
    the platform keeps the type packed (the CPU in bf16), and run as the dequantised file does."""
    kind, arch, overrides, _ = CASES["qwen3moe"]
    folder = save_tiny(arch, str(tmp_path), hf_tokenizer_dir, seed=5, **{**SIZES, **overrides})
    path = Path(folder) / f"experts-{qtype.name}.gguf"
    hf = load_hf(folder)
    with torch.no_grad():  # decisive routers: the two runs' rounding must not swap a layer's chosen experts
        for layer in hf.model.layers:
            layer.mlp.gate.weight.mul_(8.0)
    write_gguf(path, kind, hf, qtype)
    runs = []
    for quantization in ("gguf", "none"):
        llm = LLM(model=str(path), tokenizer=hf_tokenizer_dir, device="cpu", dtype="bfloat16", quantization=quantization,
                  kv_cache_memory_bytes=16 << 20)  # fmt: skip
        experts = llm.llm_engine.model.layers[0].moe.experts
        # dense: a float tensor, or on a CPU with AMX its bf16 tiles
        packed = [not isinstance(w, torch.Tensor | AmxWeight) for w in experts.gate_up + experts.down]
        assert len(experts.gate_up) == 4 and all(packed) == (quantization == "gguf") and any(packed) == all(packed)
        ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        runs.append((engine_prefill_logits(llm, ids), [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]))
        assert_all_blocks_free(llm)
    (packed_logits, packed_tokens), (dense_logits, dense_tokens) = runs
    diff = (packed_logits - dense_logits).abs()
    # measured over three seeds: max 0.037-0.079, mean 0.0036-0.0042 (logits up to 3.7): the C kernels'
    # 8-bit activations against bf16 products
    assert diff.max() < 0.15 and diff.mean() < 0.01, f"packed against dequantised: max {diff.max():.3f}, mean {diff.mean():.4f}"
    # bf16 decode steps may part on a near tie after a few tokens; the first is the prefill's argmax
    assert [t[0] for t in packed_tokens] == [t[0] for t in dense_tokens] and all(len(t) == 6 for t in packed_tokens)


@pytest.mark.parametrize(
    ("case", "layout", "tensor"),
    [
        # Mixtral GGUFs written before 2024: blk.<i>.ffn_gate.<e>.weight per expert, not stacks
        ("mixtral", dict(stacked=False), "blk.0.ffn_up.3.weight"),
        # --fuse-gate-up-exps: one ffn_gate_up_exps stack (the gate's rows, then up's) per layer
        ("qwen3moe", dict(fused_gate_up=True), "blk.0.ffn_gate_up_exps.weight"),
    ],
)
def test_other_expert_layouts(tmp_path, hf_tokenizer_dir, case, layout, tensor):
    """Expert layouts other than one stack per projection load as HF runs the model."""
    kind, arch, overrides, qtype = CASES[case]
    folder = save_tiny(arch, str(tmp_path), hf_tokenizer_dir, seed=3, **{**SIZES, **overrides})
    hf = load_hf(folder)
    path = Path(folder) / "layout.gguf"
    hf.load_state_dict(write_gguf(path, kind, hf, qtype, **layout))
    assert tensor in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    llm = LLM(model=str(path), tokenizer=hf_tokenizer_dir, device="cpu", dtype="float32", quantization="none",
              kv_cache_memory_bytes=16 << 20)  # fmt: skip
    assert llm.llm_engine.model_config.architecture == arch
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    assert max_logit_diff(llm, hf, ids) < 1e-4


@pytest.mark.parametrize("kind", ["olmoe"])
def test_kinds_transformers_does_not_model_load_their_tokenizer(tmp_path, smollm_gguf_path, kind):
    """transformers converts a GGUF's tokenizer only through the model config of the kinds it models; the
    engine converts the ``tokenizer.ggml.*`` keys of any kind (here: the embedded model's vocabulary)."""
    from engine.loader import load_tokenizer
    from engine_plugin_sdk.gguf_models import copy_gguf_tokenizer

    path = tmp_path / f"{kind}.gguf"
    writer = gguf.GGUFWriter(str(path), kind)
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(2)
    copy_gguf_tokenizer(writer, smollm_gguf_path)
    writer.add_tensor("token_embd.weight", np.zeros((49152, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    text = "Hello world, the printing press of 1450!"
    assert load_tokenizer(str(path)).encode(text) == load_tokenizer(smollm_gguf_path).encode(text)

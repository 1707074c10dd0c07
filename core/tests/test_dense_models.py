"""The decoder architectures (dense and mixtures of experts) on tiny seeded checkpoints: the CPU engine
against HF transformers in float32.

Each architecture's config sets a window of 8 tokens where it has one, so the prompts run past it.
"""

from __future__ import annotations

import pytest
import torch
from dense_model_utils import PROMPTS, hf_greedy, load_hf, max_logit_diff, save_tiny

from engine import LLM, SamplingParams
from engine_test_utils import assert_all_blocks_free

WINDOW = 8

#: architecture (``-variant`` for another config of one) -> config overrides of the tiny checkpoint
ARCHITECTURES: dict[str, dict] = {
    "LlamaForCausalLM": dict(tie_word_embeddings=True),
    "MistralForCausalLM": dict(sliding_window=WINDOW),
    "Qwen3ForCausalLM": dict(attention_bias=True),
    "GraniteForCausalLM": dict(
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.05, logits_scaling=2.0
    ),
    "Olmo2ForCausalLM": dict(),
    "Phi3ForCausalLM": dict(partial_rotary_factor=0.5, sliding_window=WINDOW, pad_token_id=0),
    "Gemma2ForCausalLM": dict(
        sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0
    ),
    "Gemma3ForCausalLM": dict(
        sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
    ),
    "GlmForCausalLM": dict(pad_token_id=0),
    "Glm4ForCausalLM": dict(pad_token_id=0),
    "SmolLM3ForCausalLM": dict(no_rope_layers=[1, 0], pad_token_id=0),
    # the default partial rotary (a quarter of each head), per-head q/k LayerNorms, sequential residual
    "StableLmForCausalLM": dict(use_qkv_bias=True, qk_layernorm=True),
    "StableLmForCausalLM-parallel": dict(use_parallel_residual=True, partial_rotary_factor=0.5),
    "CohereForCausalLM": dict(use_qk_norm=True, attention_bias=True, logit_scale=0.5),
    # mixtures of experts: 4 experts, 2 a token; Qwen2-MoE with its gated shared expert and a dense layer
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "Qwen2MoeForCausalLM": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
        norm_topk_prob=False, mlp_only_layers=[1],
    ),
    "Qwen3MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
    "OlmoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64),
    # GLM-4.5: a dense first layer, sigmoid routing with a correction bias over 2 groups of 4 experts (one
    # group chosen), renormalised and scaled, a shared expert, q/k norms and biases, half the head rotated
    "Glm4MoeForCausalLM": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, intermediate_size=64,
        use_qk_norm=True, attention_bias=True, pad_token_id=0,
    ),
    # gpt-oss: attention sinks, a sliding first layer and a global second one, biased router and experts
    # stored stacked with interleaved gate/up columns, the clamped SwiGLU, YaRN positions
    "GptOssForCausalLM": dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0,
        },
    ),
    # DeepSeek-V3: latent attention (a 56-wide latent and an 8-wide rotary key: the cache's head size is 64;
    # a compressed query; rotary pairs interleaved in the checkpoint), DeepSeek's experts
    "DeepseekV3ForCausalLM": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, intermediate_size=64,
        q_lora_rank=48, kv_lora_rank=56, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, head_dim=8,
        num_key_value_heads=4,
    ),
    # DeepSeek-V2: one q_proj, softmax routing within the 2 of 4 groups whose best expert scores highest;
    # the published latent widths (512 + a 64-wide rotary key: the cache's head size is 576)
    "DeepseekV2ForCausalLM": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5, intermediate_size=64, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=16,
        qk_rope_head_dim=64, v_head_dim=24, head_dim=64, num_key_value_heads=4,
    ),
}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def tiny(request, tmp_path_factory, hf_tokenizer_dir):
    name = request.param
    # a case is named by its architecture, with a ``-variant`` suffix for a second config of it
    path = save_tiny(name.split("-")[0], str(tmp_path_factory.mktemp(name)), hf_tokenizer_dir, **ARCHITECTURES[name])
    llm = LLM(model=path, device="cpu", dtype="float32", quantization="none", kv_cache_memory_bytes=16 << 20)
    return name, path, load_hf(path), llm


def test_prefill_logits_match_hf(tiny):
    name, _, hf, llm = tiny
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    assert max(len(t) for t in ids) > WINDOW
    diff = max_logit_diff(llm, hf, ids)
    print(f"{name}: max |logit - HF| = {diff:.2e}")
    assert diff < 1e-4, name
    assert_all_blocks_free(llm)


def test_greedy_and_logprobs_match_hf_in_one_batch(tiny):
    name, _, hf, llm = tiny
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 8), (name, prompt)
    # the first sampled token's logprob is HF's log-softmax after every final soft-cap or logit scale
    ids = llm.tokenizer.encode(PROMPTS[1])
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], dim=-1)
    first = outs[1].outputs[0]
    assert first.logprobs[0][first.token_ids[0]].logprob == pytest.approx(ref.max().item(), abs=1e-4)
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_chunked_prefill_and_prefix_cache_keep_greedy_tokens(tiny):
    name, path, _, llm = tiny
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    chunked = LLM(
        model=path, device="cpu", dtype="float32", quantization="none", kv_cache_memory_bytes=16 << 20,
        max_num_batched_tokens=8, block_size=8, enable_prefix_caching=True,
    )
    for _ in range(2):  # the second round hits the prefix cache
        outs = chunked.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, name
    assert_all_blocks_free(chunked)


@pytest.mark.parametrize(
    ("architecture", "capability", "description"),
    [("Gemma2ForCausalLM", "sliding_window", "sliding-window attention"), ("GptOssForCausalLM", "attention_sinks", "attention sinks")],
)
def test_a_platform_without_a_feature_refuses_the_model(architecture, capability, description, tmp_path, hf_tokenizer_dir, monkeypatch):
    import dataclasses

    from engine.engine_setup import EngineConfigError
    from engine_plugin_cpu.platform import CpuPlatform

    path = save_tiny(architecture, str(tmp_path), hf_tokenizer_dir, **ARCHITECTURES[architecture])
    original = CpuPlatform.capabilities
    monkeypatch.setattr(CpuPlatform, "capabilities", lambda self: dataclasses.replace(original(self), **{capability: False}))
    with pytest.raises(EngineConfigError, match=f"{architecture} needs {description}, which cpu does not support"):
        LLM(model=path, device="cpu", dtype="float32", quantization="none", kv_cache_memory_bytes=16 << 20)

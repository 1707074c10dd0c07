"""Speculative decoding with a DeepSeek-V3 checkpoint's multi-token-prediction layer (``method="mtp"``,
alias ``deepseek_mtp``), the layer written in the published layout: its forward equals a reference of the
architecture, greedy tokens are identical with and without it (several prompts, chunked prefill,
prefix-cache hits), an MTP layer built to predict its target exactly has every proposal accepted, seeded
sampling repeats, every KV block of both pools is free afterwards, and what cannot run is refused in one
line."""

from __future__ import annotations

import json
import os

import pytest
import torch
from dense_model_utils import PROMPTS, save_tiny
from eagle_heads import load_target_tensors
from mtp_checkpoints import DEEPSEEK, GLM4_MOE, add_mtp_layer, reference_mtp, save_with_mtp

from engine import LLM, SamplingParams
from engine.errors import EngineConfigError
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import parse_speculative_config
from engine_test_utils import assert_all_blocks_free

KV = 16 << 20
#: shared prefixes, so the second of two identical runs starts from cached blocks
PREFIXED = [PROMPTS[0] + " and " + tail for tail in ("bread", "cheese is sold", "a long river")] + PROMPTS[1:4]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, hf_tokenizer_dir) -> tuple[str, str, str]:
    """A two-layer DeepSeek-V3 (layer 1 experts) with an MTP layer (index 2: latent attention and
    experts), the one-layer model its block was drawn from, and the same target without the layer."""
    return save_with_mtp(str(tmp_path_factory.mktemp("mtp")), "DeepseekV3ForCausalLM", DEEPSEEK, hf_tokenizer_dir)


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory, hf_tokenizer_dir) -> tuple[str, str, str]:
    """The same with GLM-4.5, whose MTP layer has the same layout around its own block kind."""
    return save_with_mtp(str(tmp_path_factory.mktemp("mtp-glm")), "Glm4MoeForCausalLM", GLM4_MOE, hf_tokenizer_dir)


def _llm(target: str, k: int = 2, method: str | None = "mtp", **kwargs) -> LLM:
    spec = None if method is None else {"method": method, "num_speculative_tokens": k, "auto_disable": False}
    return LLM(model=target, device="cpu", dtype="float32", kv_cache_memory_bytes=KV, speculative_config=spec, **kwargs)


def _greedy(llm: LLM, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_layer_free(llm: LLM) -> None:
    proposer = llm.llm_engine.speculator.eagle
    assert proposer is not None and not proposer.mirrors
    bm = proposer.parts.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


@pytest.mark.parametrize("arch", ["deepseek", "glm"])
def test_the_mtp_forward_equals_a_reference_of_the_architecture(checkpoint, glm_checkpoint, arch):
    """One step of the engine's MTP layer over 7 positions, float32, against the layer written out in
    torch (its block transformers' DeepSeek-V3 / GLM-4.5 layer) on the same weights: outputs and logits
    within 1e-5."""
    target, block, _ = checkpoint if arch == "deepseek" else glm_checkpoint
    llm = _llm(target)
    parts = llm.llm_engine.speculator.eagle.parts
    tokens = [5, 900, 33, 4012, 17, 250, 3000]
    hidden = torch.randn(len(tokens), 128, generator=torch.Generator().manual_seed(0))
    mirror = Sequence(10**6, "unit", 0, tokens, SamplingParams(temperature=0.0), 0)
    parts.block_manager.allocate(mirror.seq_id, len(tokens))
    parts.head.use_hidden(hidden)
    logits = parts.runner.prefill_logits(SchedulerOutput([ScheduledSequence(mirror, len(tokens), True)]))
    out = parts.head.last_hidden
    parts.block_manager.free(mirror.seq_id)
    ref_out, ref_logits = reference_mtp(target, block, tokens, hidden)
    assert parts.head.layer.moe is not None and (parts.head.layer.mla is not None) == (arch == "deepseek")
    assert (out - ref_out).abs().max() < 1e-5
    assert (logits - ref_logits).abs().max() < 1e-5


@pytest.mark.parametrize("method", ["mtp", "deepseek_mtp"])
def test_greedy_tokens_are_unchanged_with_the_mtp_layer(checkpoint, method):
    """Several prompts in one batch, prefills in chunks of 16 tokens, then the same prompts again from the
    prefix cache; the target with the MTP layer in its checkpoint loads as it did without it."""
    target, _, plain = checkpoint
    expected = _greedy(_llm(plain, method=None), PREFIXED)
    assert _greedy(_llm(target, method=None), PREFIXED) == expected
    spec = _llm(target, method=method, max_num_batched_tokens=16)
    assert _greedy(spec, PREFIXED) == expected
    assert _greedy(spec, PREFIXED) == expected
    stats = spec.llm_engine.stats()
    assert stats["spec_method"] == "mtp"
    assert stats["spec_num_proposed_tokens"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert_all_blocks_free(spec)
    _assert_layer_free(spec)


def test_greedy_tokens_are_unchanged_with_a_glm_mtp_layer(glm_checkpoint):
    target, _, plain = glm_checkpoint
    expected = _greedy(_llm(plain, method=None), PREFIXED)
    spec = _llm(target, k=3, max_num_batched_tokens=16)
    assert _greedy(spec, PREFIXED) == expected
    assert spec.llm_engine.stats()["spec_num_proposed_tokens"] > 0
    assert_all_blocks_free(spec)
    _assert_layer_free(spec)


@pytest.mark.slow
def test_the_mtp_layer_beside_two_tensor_parallel_ranks_gives_one_process_tokens(glm_checkpoint):
    """The driver runs the whole layer, with the target's whole embeddings and LM head, beside its shard."""
    target, _, plain = glm_checkpoint
    expected = _greedy(_llm(plain, method=None), PROMPTS[:4])
    two = _llm(target, k=3, tensor_parallel_size=2)
    try:
        assert _greedy(two, PROMPTS[:4]) == expected
        assert two.llm_engine.stats()["spec_num_proposed_tokens"] > 0
        assert_all_blocks_free(two)
        _assert_layer_free(two)
    finally:
        two.shutdown()


def test_the_mtp_layer_refuses_pipeline_stages(glm_checkpoint):
    with pytest.raises(EngineConfigError, match="'mtp' runs on one rank; pipeline parallelism"):
        _llm(glm_checkpoint[0], pipeline_parallel_size=2)


def test_seeded_sampling_repeats_with_the_mtp_layer(checkpoint):
    spec = _llm(checkpoint[0])
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    first = [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:4], params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:4], params, use_tqdm=False)]
    assert first == again and all(first)
    assert spec.llm_engine.stats()["spec_num_proposed_tokens"] > 0
    assert_all_blocks_free(spec)
    _assert_layer_free(spec)


@pytest.fixture(scope="module")
def bigram(tmp_path_factory, hf_tokenizer_dir) -> str:
    """A one-layer DeepSeek-V3 whose attention output is zero (``o_proj`` zero) and whose embeddings have
    unit RMS: its next token depends on the current token only. Its MTP layer's block is a copy of the
    target's layer (dense, as ``first_k_dense_replace: 2`` makes index 1), ``eh_proj`` passes the
    normalised embedding through (``enorm`` ones) and its shared head is the target's final norm and LM
    head: it computes the target's next token of its input token, so every greedy proposal is the
    target's own (but at position 0, whose embedding is masked)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("mtp-bigram")
    overrides = {**DEEPSEEK, "num_hidden_layers": 1, "first_k_dense_replace": 2}
    target = save_tiny("DeepseekV3ForCausalLM", str(root / "target"), hf_tokenizer_dir, seed=8, **overrides)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
        model.model.layers[0].self_attn.o_proj.weight.zero_()
    model.save_pretrained(target)
    weights = load_target_tensors(target)
    h = emb.shape[1]
    copied = {k.removeprefix("model.layers.0."): v for k, v in weights.items() if k.startswith("model.layers.0.")}
    return add_mtp_layer(
        target, target, tensors={
            **copied, "enorm.weight": torch.ones(h), "eh_proj.weight": torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1),
            "shared_head.norm.weight": weights["model.norm.weight"], "shared_head.head.weight": weights["lm_head.weight"],
        },
    )  # fmt: skip


def test_an_mtp_layer_that_reproduces_the_target_has_its_proposals_accepted(bigram):
    prompts = [p for p in PROMPTS if len(p) > 1]
    expected = _greedy(_llm(bigram, method=None), prompts, 17)
    spec = _llm(bigram, k=4)
    assert _greedy(spec, prompts, 17) == expected
    stats = spec.llm_engine.stats()
    # 17 tokens: the prefill's, three verified steps of 4 proposals and a bonus token, then one plain decode
    assert stats["spec_acceptance_rate"] == 1.0, stats
    assert stats["spec_num_proposed_tokens"] == 3 * 4 * len(prompts)
    assert_all_blocks_free(spec)
    _assert_layer_free(spec)


def test_what_cannot_run_is_a_one_line_error(checkpoint, tmp_path):
    target, _, plain = checkpoint
    # transformers writes num_nextn_predict_layers 1 without the layer's tensors, as re-saved fine-tunes do
    with pytest.raises(EngineConfigError, match=r"num_nextn_predict_layers 1 but stores no model\.layers\.2\.\*") as err:
        _llm(plain)
    assert "\n" not in str(err.value)
    # a config without the key (an architecture without MTP layers)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(plain):
        os.symlink(os.path.join(plain, name), bare / name)
    os.unlink(bare / "config.json")
    with open(os.path.join(plain, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.pop("num_nextn_predict_layers")
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineConfigError, match="sets no num_nextn_predict_layers") as err:
        _llm(str(bare))
    assert "\n" not in str(err.value) and str(err.value).startswith("speculative_config method 'mtp'")
    with pytest.raises(ValueError, match="leave model out"):
        parse_speculative_config({"method": "mtp", "model": target, "num_speculative_tokens": 2})
    assert parse_speculative_config({"method": "deepseek_mtp", "num_speculative_tokens": 1}).method == "mtp"

"""Per-token pooling (``ALL``, ``STEP``) through ``LLM.encode``: every prompt token's final hidden state
equal to HF transformers' in float32 (across prefill chunks, normalized or not), and a process-reward
model's step scores: its head's per-token logits at the step-tag tokens, the returned labels softmaxed."""

from __future__ import annotations

import torch
from dense_model_utils import PROMPTS, load_hf, save_tiny

from engine import LLM, PoolingParams
from engine_test_utils import assert_all_blocks_free


def test_all_pooling_returns_every_token_state_across_chunks(tiny_llama_dir):
    hf = load_hf(tiny_llama_dir)
    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=8)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    raw = llm.encode(prompts, PoolingParams(pooling_type="ALL", normalize=False), use_tqdm=False)
    unit = llm.encode(prompts, PoolingParams(pooling_type="ALL", dimensions=32), use_tqdm=False)
    for ids, got, cut in zip(prompts, raw, unit):
        with torch.no_grad():
            states = hf.model(torch.tensor([ids])).last_hidden_state[0]
        assert got.outputs.data.shape == states.shape and len(got.outputs.embedding) == len(ids)
        assert torch.allclose(got.outputs.data, states, atol=1e-4)
        expected = torch.nn.functional.normalize(states[:, :32], dim=-1)
        assert torch.allclose(cut.outputs.data, expected, atol=1e-4)
    assert_all_blocks_free(llm)


def test_step_pooling_scores_each_step_tag_with_the_head(tmp_path, hf_tokenizer_dir):
    from transformers import AutoModelForSequenceClassification

    path = save_tiny("Qwen2ForSequenceClassification", str(tmp_path), hf_tokenizer_dir, num_labels=3, pad_token_id=0)
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=8)
    tag = llm.tokenizer.encode("\n")[-1]
    ids = llm.tokenizer.encode("Step 1: add two.\nStep 2: double it.\nStep 3: done.\n")
    assert ids.count(tag) == 3
    params = PoolingParams(pooling_type="STEP", task="classify", step_tag_id=tag, returned_token_ids=[0, 2])
    got = llm.encode([ids], params, use_tqdm=False)[0].outputs.data
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf.score(hf.model(torch.tensor([ids])).last_hidden_state[0])
    at_tags = logits[torch.tensor(ids) == tag][:, [0, 2]]
    assert got.shape == (3, 2)
    assert torch.allclose(got, torch.softmax(at_tags, dim=-1), atol=1e-4)
    # without a tag every token is a step; without activation the raw logits come back
    raw = llm.encode([ids], PoolingParams(pooling_type="STEP", task="classify", activation=False), use_tqdm=False)[0]
    assert torch.allclose(raw.outputs.data, logits, atol=1e-4)
    assert_all_blocks_free(llm)


def test_per_token_settings_that_do_not_apply_are_refused(tiny_llama_dir):
    import pytest

    from engine.errors import InvalidRequestError

    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    for params, message in (
        (PoolingParams(step_tag_id=5), "step_tag_id needs pooling_type STEP"),
        (PoolingParams(returned_token_ids=[1]), "returned_token_ids needs pooling_type ALL or STEP"),
        (PoolingParams(pooling_type="ALL", returned_token_ids=[256]), "in \\[0, 256\\)"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            llm.encode(PROMPTS[0], params, use_tqdm=False)
    assert_all_blocks_free(llm)

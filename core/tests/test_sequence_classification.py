"""Decoder sequence classifiers (rerankers, classifiers, reward models) through LLM.classify / score /
reward against HF transformers' AutoModelForSequenceClassification in float32 (within 1e-4)."""

from __future__ import annotations

import pytest
import torch
from dense_model_utils import PROMPTS, save_tiny

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine_test_utils import assert_all_blocks_free


def _hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(("architecture", "labels"), [("Qwen2ForSequenceClassification", 3), ("Qwen3ForSequenceClassification", 1)])
def test_classifier_probabilities_and_rewards_match_hf(architecture, labels, tmp_path, hf_tokenizer_dir):
    path = save_tiny(architecture, str(tmp_path), hf_tokenizer_dir, num_labels=labels, pad_token_id=0)
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=8)
    classified = llm.classify(PROMPTS[:3], use_tqdm=False)
    rewards = llm.reward(PROMPTS[:3], use_tqdm=False)
    for prompt, probs, reward in zip(PROMPTS[:3], classified, rewards):
        logits = _hf_logits(path, llm.tokenizer.encode(prompt))
        expected = torch.sigmoid(logits) if labels == 1 else torch.softmax(logits, dim=-1)
        assert torch.allclose(torch.tensor(probs.outputs.probs), expected, atol=1e-4)
        assert torch.allclose(reward.outputs.data, logits, atol=1e-4)
    with pytest.raises(InvalidRequestError, match="no LM head"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_score_runs_pairs_as_the_tokenizer_joins_them(tmp_path, hf_tokenizer_dir):
    path = save_tiny("Qwen2ForSequenceClassification", str(tmp_path), hf_tokenizer_dir, num_labels=1, pad_token_id=0)
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    query, documents = "What is the capital of France?", ["Paris is the capital.", "Bananas are yellow."]
    scores = llm.score(query, documents, use_tqdm=False)
    for document, scored in zip(documents, scores):
        ids = llm.tokenizer.encode_pair(query, document)
        assert scored.outputs.score == pytest.approx(torch.sigmoid(_hf_logits(path, ids))[0].item(), abs=1e-4)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(["a", "b"], ["c", "d", "e"])


def test_an_embedding_model_refuses_classification(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    with pytest.raises(InvalidRequestError, match="no classification head"):
        llm.classify(PROMPTS[0], use_tqdm=False)

"""The embedded SmolLM2 GGUF: greedy tokens equal Hugging Face transformers loading the same file in fp32."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine_test_utils import assert_all_blocks_free

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "def add(a, b):",
    "Translate to French: Good morning, how are you today? I hope the weather is nice where you are.",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", kv_cache_memory_bytes=256 << 20)


@pytest.mark.slow
def test_greedy_64_tokens_equal_hf_on_a_mixed_batch(hf_smollm2, llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)
    eos = 2
    prompt_ids = [out.prompt_token_ids for out in outs]
    assert prompt_ids == [llm.tokenizer.encode(p) for p in PROMPTS]
    for prompt, ids, out in zip(PROMPTS, prompt_ids, outs, strict=True):
        tokens = out.outputs[0].token_ids
        # HF's greedy decoding, checked in one forward over the prompt and the engine's tokens (a fifth of
        # the time of HF's generate): each token is HF's argmax after those before it, and the output ends
        # at its first EOS or at 64 tokens, so HF's greedy generate gives these very tokens
        with torch.no_grad():
            logits = hf_smollm2(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
        assert logits.argmax(-1).tolist() == tokens, prompt
        assert eos not in tokens[:-1] and (len(tokens) == 64 or tokens[-1] == eos), prompt
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_chat_answers_like_hf(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    assert out[0].outputs[0].text.strip() == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"
    assert_all_blocks_free(llm)

"""The embedded SmolLM2 GGUF: greedy tokens equal Hugging Face transformers loading the same file in fp32."""

from __future__ import annotations

import os

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
def hf_model(smollm_gguf_path):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm_gguf_path), gguf_file=os.path.basename(smollm_gguf_path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", kv_cache_memory_bytes=256 << 20)


@pytest.mark.slow
def test_greedy_64_tokens_equal_hf_on_a_mixed_batch(hf_model, llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)
    eos = 2
    for prompt, out in zip(PROMPTS, outs):
        ids = out.prompt_token_ids
        assert ids == llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=64, do_sample=False, eos_token_id=eos, pad_token_id=eos,
            )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == ref, prompt
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_chat_answers_like_hf(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    assert out[0].outputs[0].text.strip() == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"
    assert_all_blocks_free(llm)

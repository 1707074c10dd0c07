"""Beam search against Hugging Face transformers' beam search on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.beam_search import BeamSearchParams
from engine_test_utils import assert_all_blocks_free


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, block_size=8)
    return hf, llm


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 0.5)])
def test_beams_equal_hf(models, width, length_penalty):
    hf, llm = models
    prompts = ["The history of the", "Once upon"]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                num_beams=width, num_return_sequences=width, max_new_tokens=10, min_new_tokens=10,
                do_sample=False, length_penalty=length_penalty, early_stopping=False, pad_token_id=0,
                output_scores=True, return_dict_in_generate=True,
            )
        ref_tokens = [row[len(ids) :].tolist() for row in ref.sequences]
        assert [h.token_ids for h in out.outputs] == ref_tokens
        torch.testing.assert_close(
            torch.tensor([h.cumulative_logprob / len(h.token_ids) ** length_penalty for h in out.outputs]),
            ref.sequences_scores.float(), rtol=1e-4, atol=1e-4,
        )
    assert_all_blocks_free(llm)


def test_beams_share_blocks(models):
    _, llm = models
    engine = llm.llm_engine
    peak = 0
    original = engine.runner.launch

    def spying_launch(plan, gen, *args, **kwargs):
        nonlocal peak
        peak = max(peak, engine.num_total_blocks - engine.num_free_blocks)
        return original(plan, gen, *args, **kwargs)

    engine.runner.launch = spying_launch
    try:
        prompt = "word " * 60  # 61 tokens: 8 blocks of 8 before any generated token
        llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True))
    finally:
        engine.runner.launch = original
    # Four unshared beams would need 4 * 9 blocks; sharing keeps it near one prompt's worth.
    assert peak <= 8 + 4 + 4
    assert_all_blocks_free(llm)


def test_beam_requests_batch_with_sampling_requests_and_abort_cleanly(models):
    from engine import SamplingParams

    _, llm = models
    engine = llm.llm_engine
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    alone = llm.beam_search("The history of the", params)[0]
    engine.add_request("greedy", "Numbers: 1, 2,", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.add_request("beam", "The history of the", params)
    engine.add_request("beam-aborted", "Once upon", params)
    done = {}
    for _ in range(3):
        for out in engine.step():
            done[out.request_id] = out
    engine.abort_request("beam-aborted")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [c.token_ids for c in done["beam"].outputs] == [c.token_ids for c in alone.outputs]
    assert len(done["greedy"].outputs[0].token_ids) == 6
    assert "beam-aborted" not in done or not done["beam-aborted"].finished
    assert_all_blocks_free(llm)

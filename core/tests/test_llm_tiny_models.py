"""Tiny random Llama and Qwen2 checkpoints: the engine against Hugging Face transformers, in fp32."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine_test_utils import assert_all_blocks_free

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3,",
    "def fibonacci(n):\n    ",
    "A",
    "Paged attention stores the key value cache in fixed size blocks so that memory is not wasted on",
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_llama_dir, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20)
    return path, hf, llm


def assert_hf_greedy(hf, ids: list[int], tokens: list[int], prompt: str) -> None:
    """``tokens`` are HF's greedy continuation of ``ids``, EOS barred as ``dense_model_utils.hf_greedy``'s
    ``min_new_tokens`` bars it: each token is HF's argmax after the ones before it, all checked in one
    forward instead of a generate step a token."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
    logits[:, hf.generation_config.eos_token_id] = float("-inf")
    assert logits.argmax(-1).tolist() == tokens, prompt


@pytest.fixture(scope="module")
def greedy_40(tiny) -> list[list[int]]:
    """The model's unpreempted greedy outputs, that both preemption modes must give (generated once)."""
    _, _, llm = tiny
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_prefill_logits_match_hf(tiny):
    _, hf, llm = tiny
    engine = llm.llm_engine
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    # Run three prompts as one flat batch through the engine's runner, then compare every position.
    seqs = [
        Sequence(seq_id=10_000 + i, request_id=f"logits-{i}", index=0, prompt_token_ids=t, params=SamplingParams(), arrival=i)
        for i, t in enumerate(ids)
    ]
    for s in seqs:
        engine.block_manager.allocate(s.seq_id, s.num_tokens)
    try:
        logits = engine.runner.prefill_logits(SchedulerOutput([ScheduledSequence.of(s, s.num_tokens) for s in seqs]))
    finally:
        for s in seqs:
            engine.block_manager.free(s.seq_id)
    offset = 0
    for t in ids:
        with torch.no_grad():
            ref = hf(torch.tensor([t])).logits[0]
        ours = logits[offset : offset + len(t)]
        offset += len(t)
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert_all_blocks_free(llm)


def test_greedy_32_tokens_match_hf_in_one_batch(tiny):
    _, hf, llm = tiny
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert len(out.outputs[0].token_ids) == 32, prompt
        assert_hf_greedy(hf, ids, out.outputs[0].token_ids, prompt)
        assert out.outputs[0].finish_reason == "length"
    assert_all_blocks_free(llm)


def test_scheduler_delay_factor_holds_arrivals_while_others_run_and_keeps_outputs_identical(tiny, greedy_40):
    path, _, _ = tiny
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # a factor this large never lets the wait pass: an arrival is admitted once nothing else runs
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20, scheduler_delay_factor=1e6)
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[0], params)
    engine.step()
    engine.add_request("b", PROMPTS[1], params)
    outputs: dict[str, list[int]] = {}
    held = 0
    while engine.has_unfinished_requests():
        running_a = "a" not in outputs
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        held += running_a and engine.scheduler.num_waiting == 1
    assert held >= 30  # b waited while a decoded its 40 tokens
    assert [outputs["a"], outputs["b"]] == greedy_40[:2]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_every_output_identical(tiny, greedy_40, mode):
    path, _, _ = tiny
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # 12 blocks of 8 tokens cannot hold six sequences of up to ~60 tokens: preemption must happen.
    small = LLM(
        model=path, device="cpu", dtype="float32", block_size=8, num_blocks_override=12, max_num_batched_tokens=64,
        preemption_mode=mode,
    )
    outs = small.generate(PROMPTS, params, use_tqdm=False)
    scheduler = small.llm_engine.scheduler
    assert scheduler.num_preemptions > 0
    assert (scheduler.num_swaps_out > 0) == (mode == "swap")
    assert [o.outputs[0].token_ids for o in outs] == greedy_40
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_all_blocks_free(small)


def test_logprobs_of_first_token_match_hf(tiny):
    _, hf, llm = tiny
    prompt = PROMPTS[1]
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), use_tqdm=False)[0]
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], dim=-1)
    top = torch.topk(ref, 5)
    entry = out.outputs[0].logprobs[0]
    for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        assert tid in entry
        assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)
        assert entry[tid].rank == rank
    assert out.outputs[0].token_ids[0] == top.indices[0].item()
    assert_all_blocks_free(llm)

"""Speculative decoding (n-gram prompt lookup): greedy outputs identical with and without it on mixed
batches, the verification keeping the target's distribution at temperature 1 (a statistical test), every
KV block free afterwards, acceptance statistics, and one-line errors for a bad speculative_config."""

from __future__ import annotations

import json

import pytest
import torch
from dense_model_utils import PROMPTS

from engine import LLM, SamplingParams
from engine.sampling.params import SamplingParams as Params
from engine.sampling.sampler import Sampler, SamplingRow
from engine.speculative.ngram import propose_ngram
from engine.speculative.verify import verify
from engine_test_utils import assert_all_blocks_free

#: the speculation switch off: these tests count proposals, which its timing-driven choices would change
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "auto_disable": False}
#: prompts the model continues by repeating them, so that prompt lookup has something to propose
REPETITIVE = [
    "one two three four five one two three four five one two three",
    "The cat sat on the mat. The cat sat on the mat. The cat",
]


def test_ngram_proposes_what_followed_the_latest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]
    assert propose_ngram([5, 6, 7], 3, 1, 2) == []
    assert propose_ngram([4, 4, 4], 3, 1, 1) == [4]


def _greedy(llm: LLM, prompts: list[str], max_tokens: int = 20) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_tokens_are_unchanged_on_a_mixed_batch(tiny_llama_dir, monkeypatch):
    """A random tiny model never repeats itself, so prompt lookup would propose nothing: an oracle that
    proposes the known greedy continuation, every third proposal corrupted, exercises acceptance and
    rejection (and stops by max_tokens and the context) on a batch mixing prompt lengths."""
    kwargs = dict(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    base = LLM(**kwargs)
    prompts = REPETITIVE + PROMPTS[:3]
    expected = _greedy(base, prompts)
    by_prompt = {tuple(base.tokenizer.encode(p)): e for p, e in zip(prompts, expected)}
    calls = []

    def oracle(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        for prompt, continuation in by_prompt.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                proposal = list(continuation[done : done + k])
                calls.append(len(proposal))
                if proposal and len(calls) % 3 == 0:
                    proposal[-1] = (proposal[-1] + 1) % 1000
                return proposal
        return []

    monkeypatch.setattr("engine.speculative.speculator.propose_ngram", oracle)
    spec = LLM(**kwargs, speculative_config=NGRAM, max_num_batched_tokens=16)
    assert _greedy(spec, prompts) == expected
    stats = spec.llm_engine.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_proposed_tokens"]
    assert_all_blocks_free(spec)


@pytest.mark.slow
def test_the_embedded_model_accepts_proposals_and_keeps_its_tokens():
    kwargs = dict(device="cpu", dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20)
    expected = _greedy(LLM(**kwargs), REPETITIVE, 24)
    spec = LLM(**kwargs, speculative_config=NGRAM)
    assert _greedy(spec, REPETITIVE, 24) == expected
    stats = spec.llm_engine.stats()
    assert stats["spec_acceptance_rate"] > 0.3 and stats["spec_mean_accepted_length"] > 1.5
    assert_all_blocks_free(spec)


def test_verification_keeps_the_target_distribution_at_temperature_one():
    """Rejection sampling against a point-mass proposal: the first emitted token follows p_0 whatever
    the proposal, and the second, given the first proposal was accepted, follows p_1."""
    torch.manual_seed(5)
    vocab, trials = 6, 20000
    logits = torch.randn(3, vocab) * 1.5
    probs = torch.softmax(logits, dim=-1)
    sampler = Sampler([vocab + 1], vocab)
    row = SamplingRow(Params(temperature=1.0), [0], [], None)
    generator = torch.Generator().manual_seed(7)
    # a middling first proposal (accepted now and then), the likeliest second
    drafts = [int(probs[0].argsort(descending=True)[1]), int(probs[1].argmax())]
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(trials):
        kept = verify(sampler, logits, row, drafts, generator).result.token_ids
        first[kept[0]] += 1
        if kept[0] == drafts[0]:
            second[kept[1]] += 1
    # total variation within a few standard errors of the counts
    assert (first / trials - probs[0]).abs().sum() < 0.03
    assert second.sum() > 800 and (second / second.sum() - probs[1]).abs().sum() < 0.08


def test_a_bad_speculative_config_is_a_one_line_error(tiny_llama_dir):
    for config, message in (
        ({"method": "medusa", "num_speculative_tokens": 2}, "method 'medusa' is not supported"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "exceeds"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ):
        with pytest.raises(ValueError, match=message):
            LLM(model=tiny_llama_dir, device="cpu", speculative_config=config)


@pytest.mark.parametrize(
    "spec",
    [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}, {"method": "suffix"},
     {"model": "/some/draft", "num_speculative_tokens": 2}, {"method": "eagle3", "model": "/h", "num_speculative_tokens": 4}],
)  # fmt: skip
def test_a_speculative_config_survives_the_trip_to_worker_processes(spec):
    """Ranks and replicas receive the engine's configuration as JSON: it must validate there again (the
    other methods' defaulted settings are not in the dump, which would name them as this method's)."""
    from engine.config import EngineConfig

    config = EngineConfig(model="m", speculative_config=spec)
    again = EngineConfig.model_validate_json(config.model_dump_json())
    assert again.speculative_config == config.speculative_config


def test_speculation_counters_reach_the_metrics(tiny_llama_dir):
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from engine.async_engine import AsyncLLMEngine
    from engine.entrypoints.openai.server import build_app

    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, speculative_config=NGRAM)
    with TestClient(build_app(AsyncLLMEngine(llm.llm_engine))) as client:
        assert client.post("/v1/completions", json={"prompt": REPETITIVE[0], "max_tokens": 8}).status_code == 200
        names = {f.name for f in text_string_to_metric_families(client.get("/metrics").text)}
        stats = client.get("/v1/engine/stats").json()
    assert {"engine:spec_decode_num_draft_tokens", "engine:spec_decode_num_accepted_tokens"} <= names
    assert "spec_acceptance_rate" in json.dumps(stats)

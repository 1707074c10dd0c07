"""The core's padded decode-graph path on this plugin's kernels, through the public ``LLM`` API.

On a GPU the engine replays real CUDA graphs. In the interpreter the platform claims no graphs, so the
test claims them for it: the graph capture is then the eager fallback, which still runs the padded
bucket inputs (slot -1, context length 0 rows), so the padding logic is checked against the plain eager
engine either way.
"""

from __future__ import annotations

import dataclasses

import pytest
from interpreted_llama import greedy_tokens, tiny_llama_reference

from engine import LLM, SamplingParams
from engine_plugin_nvidia.platform import INTERPRET_ENV, CudaPlatform
from engine_plugin_sdk import Capabilities, GraphCapture

PROMPTS = [[1, 5, 9, 33, 7], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 100], [1, 7, 8]]


def generate(llm: LLM) -> list[list[int]]:
    return greedy_tokens(llm, PROMPTS)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], list[list[int]]]:
    """The tiny Llama's engine settings on this plugin in the interpreter, and its eager greedy tokens (one layer:
    the padding rows go through a second one as through the first)."""
    return tiny_llama_reference(tmp_path_factory.mktemp("tiny-llama"), PROMPTS, max_num_seqs=6, num_layers=1)


def count_runs(capture: GraphCapture) -> list[int]:
    """The batch sizes ``capture.run`` is called with from now on (the list grows as it runs)."""
    calls: list[int] = []
    original_run = capture.run

    def counting_run(batch_size: int, *inputs: object) -> object:
        calls.append(batch_size)
        return original_run(batch_size, *inputs)

    capture.run = counting_run  # type: ignore[method-assign]
    return calls


@pytest.mark.slow
def test_padded_decode_graph_path_matches_eager(
    tiny_llama: tuple[dict[str, object], list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(INTERPRET_ENV, "1")
    common, eager = tiny_llama

    claims = CudaPlatform.capabilities

    def with_graphs(self: CudaPlatform) -> Capabilities:
        return dataclasses.replace(claims(self), graph_capture=True)

    monkeypatch.setattr(CudaPlatform, "capabilities", with_graphs)
    llm = LLM(**common)
    graphs = llm.llm_engine.runner.decode_graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 6]
    calls = count_runs(graphs.graphs)
    assert generate(llm) == eager
    assert calls and set(calls) <= set(graphs.buckets), f"decode steps should pad to a bucket, got {calls}"


@pytest.mark.slow
def test_padded_verification_graph_path_matches_eager(
    tiny_llama: tuple[dict[str, object], list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative verification steps through the verification graphs' padded buckets (rows of 1 to k + 1
    tokens, proposals of every length from an oracle, some wrong) give the eager engine's greedy tokens."""
    monkeypatch.setenv(INTERPRET_ENV, "1")
    common, expected = tiny_llama
    by_prompt = {tuple(p): e for p, e in zip(PROMPTS, expected)}
    lengths: list[int] = []

    def oracle(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        prompt = next(p for p in by_prompt if tuple(tokens[: len(p)]) == p)
        done = len(tokens) - len(prompt)
        proposal = list(by_prompt[prompt][done : done + len(lengths) % (k + 1)])
        if proposal and len(lengths) % 3 == 0:
            proposal[-1] = (proposal[-1] + 1) % 100
        lengths.append(len(proposal))
        return proposal

    claims = CudaPlatform.capabilities
    monkeypatch.setattr(CudaPlatform, "capabilities", lambda self: dataclasses.replace(claims(self), graph_capture=True))
    monkeypatch.setattr("engine.speculative.speculator.propose_ngram", oracle)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "auto_disable": False}
    llm = LLM(**common, speculative_config=ngram)
    verifying = llm.llm_engine.runner.verify_graphs
    assert verifying is not None and verifying.buckets == [1, 2, 4, 6] and verifying.query_len == 4
    calls = count_runs(verifying.graphs)
    assert generate(llm) == expected
    assert calls and set(calls) <= set(verifying.buckets), f"verification steps should pad to a bucket, got {calls}"
    stats = llm.llm_engine.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_proposed_tokens"]
    assert {0, 1, 2, 3} <= set(lengths)


@pytest.mark.slow
def test_padded_prompt_graph_path_matches_eager(
    tiny_llama: tuple[dict[str, object], list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts run one at a time go through the prompt graphs' token buckets (padding rows that write
    nowhere and extend the context), a chunk over a cached prefix too, and give the eager engine's tokens."""
    monkeypatch.setenv(INTERPRET_ENV, "1")
    common, _ = tiny_llama
    # each prompt's token and one decode step over the KV its padded prompt step wrote
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    long_prompt = [1, *range(80, 119)]  # two whole blocks are cached after it runs
    prompts = [*PROMPTS, long_prompt, [*long_prompt, 5, 6, 7, 8, 9]]

    def one_at_a_time(llm: LLM) -> list[list[int]]:
        return [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]

    eager = one_at_a_time(LLM(**common, enforce_eager=True))
    claims = CudaPlatform.capabilities
    monkeypatch.setattr(CudaPlatform, "capabilities", lambda self: dataclasses.replace(claims(self), graph_capture=True))
    llm = LLM(**common, enable_prefix_caching=True)
    prompt_graphs = llm.llm_engine.runner.prefill_graphs
    # up to the tiny model's context of 256 tokens
    assert prompt_graphs is not None and prompt_graphs.buckets == [16, 32, 64, 128, 256]
    calls = count_runs(prompt_graphs.graphs)
    assert one_at_a_time(llm) == eager
    # every prompt in the 16-token bucket but the long one (40 tokens) and its successor's uncached 13
    assert calls == [16, 16, 16, 16, 64, 16], calls
    assert llm.llm_engine.stats()["prefix_cache_hit_tokens"] == 32

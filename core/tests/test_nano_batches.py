"""Dual-batch overlap (``enable_dbo``): large decode steps as two nano-batches on the platform's two lanes.

Through ``LLM`` on the test-only ``reference-dbo`` platform (``overlap_lanes_plugin``), whose lanes are one
queue audited as two streams: the overlapped steps give the whole steps' tokens and log-probabilities, and
no op reads the other lane's result before a hand-over would have ordered it. Refusals are one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dense_model_utils import save_tiny
from overlap_lanes_plugin import DEVICE, AuditedStepOverlap, write_entry_point
from test_dense_models import ARCHITECTURES

from engine import LLM, SamplingParams
from engine.errors import EngineConfigError
from engine.interfaces.step_overlap import Lane
from engine_test_utils import assert_all_blocks_free

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "1, 2, 3, 4,",
    "Paged attention stores keys and values in blocks",
    "A",
]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture
def overlap_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The ``reference-dbo`` plugin on this process's path."""
    site = tmp_path / "site"
    write_entry_point(site)
    monkeypatch.syspath_prepend(str(site))
    yield


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, device=DEVICE, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=8, **kwargs)


def _run(llm: LLM) -> list:
    return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _same_outputs(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            for token in step_a:
                assert abs(step_a[token].logprob - step_b[token].logprob) < 1e-4


OVERRIDES = {
    "LlamaForCausalLM": {},
    # a mixture of experts with per-head q/k norms
    "Qwen3MoeForCausalLM": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    # attention and MLP in parallel branches from one norm
    "CohereForCausalLM": {},
    # KV groups (a sliding layer and a global one: a block table per group), attention sinks, experts
    "GptOssForCausalLM": ARCHITECTURES["GptOssForCausalLM"],
}


@pytest.mark.parametrize("architecture", list(OVERRIDES))
def test_overlapped_decode_steps_equal_whole_ones_and_hand_over_before_every_cross_lane_read(
    architecture, overlap_plugin, hf_tokenizer_dir, tmp_path
):
    path = save_tiny(architecture, str(tmp_path / architecture), hf_tokenizer_dir, seed=3, **OVERRIDES[architecture])
    want = _run(_llm(path))
    # five sequences decode together: the threshold of 3 cuts those steps (2 + 3 rows), not the later ones
    llm = _llm(path, enable_dbo=True, dbo_decode_token_threshold=3)
    overlap = llm.llm_engine.runner.model.step_overlap
    assert isinstance(overlap, AuditedStepOverlap)
    got = _run(llm)
    _same_outputs(got, want)
    model = llm.llm_engine.runner.model
    layers = len(model.layers)
    if architecture == "GptOssForCausalLM":
        assert llm.llm_engine.runner.kv_layout is not None  # the steps carry one metadata per KV group
    assert overlap.steps >= GREEDY.max_tokens - 1  # every decode step of the five sequences
    # each nano-batch hands each layer's q/k/v to the attention lane and its result back
    assert overlap.hand_overs == {Lane.ATTENTION: 2 * layers * overlap.steps, Lane.COMPUTE: 2 * layers * overlap.steps}
    assert overlap.violations == []
    assert_all_blocks_free(llm)


def test_steps_below_the_threshold_run_whole(overlap_plugin, tiny_llama_dir):
    llm = _llm(tiny_llama_dir, enable_dbo=True, dbo_decode_token_threshold=6)
    _run(llm)
    assert llm.llm_engine.runner.model.step_overlap.steps == 0


def test_the_audit_catches_a_read_without_a_hand_over():
    # the audit must be able to fail: the attention lane reads a compute-lane result it never waited for
    overlap = AuditedStepOverlap()
    overlap.begin()
    x = torch.randn(4) + 1
    with overlap.lane(Lane.ATTENTION):
        y = x * 2
    overlap.hand_over(Lane.COMPUTE, [y])
    _ = y + 1
    overlap.end()
    assert len(overlap.violations) == 1 and "attention lane" in overlap.violations[0]


def test_enable_dbo_is_refused_in_one_line_where_it_cannot_run(overlap_plugin, hf_tokenizer_dir, tiny_llama_dir, tmp_path):
    with pytest.raises(EngineConfigError, match="does not claim step_overlap") as cpu:
        LLM(model=tiny_llama_dir, device="cpu", dtype="float32", enable_dbo=True)
    assert "\n" not in str(cpu.value)
    # Gemma-2 fuses each post-norm with the next layer's pre-norm across the layer boundary
    gemma = save_tiny("Gemma2ForCausalLM", str(tmp_path / "gemma2"), hf_tokenizer_dir, sliding_window=8)
    with pytest.raises(EngineConfigError, match="Gemma2ForCausalLM cannot overlap its steps: its post-norms fuse"):
        _llm(gemma, enable_dbo=True)
    with pytest.raises(EngineConfigError, match="does not combine with tensor or pipeline parallelism"):
        _llm(tiny_llama_dir, enable_dbo=True, tensor_parallel_size=2)

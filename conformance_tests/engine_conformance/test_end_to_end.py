"""End to end: a tiny random Llama on the plugin generates HF transformers' greedy tokens, with its logprobs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import default_geometry, most_precise_dtype
from engine_conformance.pytest_plugin import PlatformTarget, not_claimed, plugin_manager_of
from engine_plugin_sdk.testing import (
    MAX_TOKENS,
    PROMPTS,
    TOP_LOGPROBS,
    build_tiny_llama,
    hf_greedy,
    run_to_completion,
)
from engine_plugin_sdk.tolerances import get_tolerance


def engine_generate(
    platform_target: PlatformTarget,
    manager: Any,
    folder: Path,
    dtype: str,
    block_size: int,
    n: int = 1,
    parallel: dict[str, Any] | None = None,
) -> list[Any]:
    """Run the prompts through the engine on this plugin's platform (the same path as ``engine.LLM``);
    ``parallel`` holds ``ParallelConfig`` fields."""
    try:
        from engine.config import CacheConfig, EngineConfig, ParallelConfig
        from engine.llm_engine import LLMEngine
        from engine.sampling.params import SamplingParams
    except ImportError as exc:
        pytest.skip(f"engine.LLM not available: {exc}")
    config = EngineConfig(
        model=str(folder),
        device=platform_target.name,
        dtype=dtype,
        cache=CacheConfig(block_size=block_size),
        parallel=ParallelConfig(**(parallel or {})),
    )
    engine = LLMEngine.from_config(config, manager)
    params = SamplingParams(
        n=n, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS
    )
    return run_to_completion(engine, PROMPTS, params)


@pytest.mark.slow
@pytest.mark.capability("e2e.greedy")
def test_tiny_llama_matches_transformers(
    caps: Capabilities, platform_target: PlatformTarget, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    check_tiny_llama(caps, platform_target, tmp_path, request, "e2e")


@pytest.mark.slow
@pytest.mark.capability("e2e.step_overlap")
def test_overlapped_decode_steps_match_transformers(
    caps: Capabilities, platform_target: PlatformTarget, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``enable_dbo``: decode steps of the three prompts cut into two nano-batches (one and two rows), each
    layer's attention on the platform's second lane; the tokens and logprobs are transformers' still."""
    if not caps.step_overlap:
        not_claimed("overlapped steps (step_overlap) are not claimed")
    parallel = {"enable_dbo": True, "dbo_decode_token_threshold": len(PROMPTS)}
    check_tiny_llama(caps, platform_target, tmp_path, request, "e2e.step_overlap", parallel)


def check_tiny_llama(
    caps: Capabilities,
    platform_target: PlatformTarget,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    row: str,
    parallel: dict[str, Any] | None = None,
) -> None:
    """A tiny random Llama in the most precise claimed dtype, through the engine on the plugin, against
    transformers (``parallel``: ``ParallelConfig`` fields)."""
    geo = default_geometry(caps)
    dtype_name = most_precise_dtype(caps)
    model = build_tiny_llama(tmp_path, geo.head_size)
    outputs = engine_generate(
        platform_target, plugin_manager_of(request.config), tmp_path, dtype_name, geo.block_size, parallel=parallel
    )
    assert_matches_transformers(model, outputs, get_tolerance(dtype_name).logits_atol, row)


def assert_matches_transformers(model: Any, outputs: list[Any], atol: float, row: str) -> None:
    """Each prompt's greedy tokens and logprobs against transformers' (``row`` names the failing row)."""
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected_tokens, expected_logprobs = hf_greedy(model, prompt)
        got = out.outputs[0]
        assert list(out.prompt_token_ids) == prompt, (
            f"{row}.greedy: prompt ids changed to {out.prompt_token_ids}"
        )
        assert got.logprobs is not None and len(got.logprobs) == MAX_TOKENS, (
            f"{row}.logprobs: missing per-step logprobs"
        )
        # Tokens must equal transformers' except where transformers' own top two are within the dtype's
        # tolerance of each other (a near-tie that rounding may legitimately flip); after such a flip the
        # continuations differ, so comparison stops there.
        compared = MAX_TOKENS
        for step, (token, reference) in enumerate(zip(got.token_ids, expected_logprobs, strict=True)):
            if token != expected_tokens[step]:
                top2 = torch.topk(reference, 2).values
                margin = float(top2[0] - top2[1])
                assert margin < 2 * atol, (
                    f"{row}.greedy: prompt {prompt[:4]}... generated {list(got.token_ids)}, transformers "
                    f"{expected_tokens} (first difference at step {step}, top-2 margin {margin:.4f})"
                )
                compared = step + 1
                break
        for step, (reported, reference) in enumerate(zip(got.logprobs[:compared], expected_logprobs, strict=False)):
            for token_id, logprob in reported.items():
                want = float(reference[token_id])
                assert math.isclose(logprob.logprob, want, abs_tol=atol), (
                    f"{row}.logprobs: step {step} token {token_id}: logprob {logprob.logprob:.6f}, "
                    f"transformers {want:.6f} (atol {atol})"
                )


@pytest.mark.slow
@pytest.mark.capability("e2e.greedy.n2")
def test_two_greedy_samples_agree(
    platform: Platform,
    caps: Capabilities,
    platform_target: PlatformTarget,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """``n=2`` at temperature 0: both samples share the prompt's blocks (forked copy-on-write when the
    last one is partly filled) and must generate the same tokens with the same logprobs."""
    geo = default_geometry(caps)
    dtype_name = most_precise_dtype(caps)
    build_tiny_llama(tmp_path, geo.head_size)
    outputs = engine_generate(
        platform_target, plugin_manager_of(request.config), tmp_path, dtype_name, geo.block_size, n=2
    )
    atol = get_tolerance(dtype_name).logits_atol
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert len(out.outputs) == 2, f"e2e.greedy.n2: {len(out.outputs)} samples for n=2"
        first, second = out.outputs
        assert list(first.token_ids) == list(second.token_ids), (
            f"e2e.greedy.n2: prompt {prompt[:4]}... gave {list(first.token_ids)} and {list(second.token_ids)}"
        )
        assert len(first.token_ids) == MAX_TOKENS, f"e2e.greedy.n2: {len(first.token_ids)} tokens"
        for step, (a, b) in enumerate(zip(first.logprobs or [], second.logprobs or [], strict=True)):
            for token_id, logprob in a.items():
                other = b.get(token_id)
                assert other is not None and math.isclose(logprob.logprob, other.logprob, abs_tol=atol), (
                    f"e2e.greedy.n2: step {step} token {token_id}: logprobs {logprob.logprob:.6f} and "
                    f"{None if other is None else round(other.logprob, 6)}"
                )

"""End to end at a realistic shape: a hidden size that is not a power of two and a prompt of 217 tokens.

The tiny model of ``test_end_to_end.py`` has power-of-two widths and prompts of at most 20 tokens, so
every GEMM, norm and prefill it runs is one tile wide; here the hidden size is 576 (9 heads of 64, as in
SmolLM2-135M), the MLP 960 wide, and the prompt's prefill spans several query tiles and KV blocks, then
decodes over that context. The reference is HF transformers' float32 forward, compared in float64.
"""

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
    LONG_PROMPT,
    MAX_TOKENS,
    PROMPTS,
    TOP_LOGPROBS,
    build_tiny_llama,
    hf_greedy,
    run_to_completion,
)
from engine_plugin_sdk.tolerances import get_tolerance

HEAD_DIM = 64
NUM_HEADS = 9  # hidden size 576
NUM_KV_HEADS = 3
INTERMEDIATE = 960
CAPABILITY = "e2e.long_prompt"


def generate(
    platform_target: PlatformTarget, manager: Any, folder: Path, dtype: str, block_size: int
) -> list[Any]:
    """The long prompt and a short one, batched through the engine on this plugin's platform."""
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling.params import SamplingParams

    config = EngineConfig(
        model=str(folder), device=platform_target.name, dtype=dtype, cache=CacheConfig(block_size=block_size)
    )
    engine = LLMEngine.from_config(config, manager)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)
    return run_to_completion(engine, [LONG_PROMPT, PROMPTS[0]], params)


def check_against_reference(model: Any, prompt: list[int], got: Any, atol: float) -> None:
    """Greedy tokens equal transformers' up to a near-tie, and every reported logprob is within ``atol``."""
    expected_tokens, expected_logprobs = hf_greedy(model, prompt)
    assert got.logprobs is not None and len(got.logprobs) == MAX_TOKENS, f"{CAPABILITY}: missing logprobs"
    compared = MAX_TOKENS
    for step, token in enumerate(got.token_ids):
        if token != expected_tokens[step]:
            # a flip is allowed only where transformers' own top two are within rounding of each other
            top2 = torch.topk(expected_logprobs[step], 2).values
            margin = float(top2[0] - top2[1])
            assert margin < 2 * atol, (
                f"{CAPABILITY}: {len(prompt)}-token prompt generated {list(got.token_ids)}, transformers "
                f"{expected_tokens} (first difference at step {step}, top-2 margin {margin:.4f})"
            )
            compared = step + 1
            break
    for step, (reported, reference) in enumerate(
        zip(got.logprobs[:compared], expected_logprobs, strict=False)
    ):
        for token_id, logprob in reported.items():
            want = float(reference[token_id])
            assert math.isclose(logprob.logprob, want, abs_tol=atol), (
                f"{CAPABILITY}: {len(prompt)}-token prompt, step {step} token {token_id}: logprob "
                f"{logprob.logprob:.6f}, transformers {want:.6f} (atol {atol})"
            )


@pytest.mark.slow
@pytest.mark.capability(CAPABILITY)
def test_long_prompt_on_a_non_power_of_two_model(
    platform: Platform,
    caps: Capabilities,
    platform_target: PlatformTarget,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    if HEAD_DIM not in caps.head_sizes:
        not_claimed(f"head size {HEAD_DIM} (claimed: {list(caps.head_sizes)})")
    block_size = default_geometry(caps).block_size
    dtype_name = most_precise_dtype(caps)
    model = build_tiny_llama(
        tmp_path, HEAD_DIM, seed=5, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
        intermediate_size=INTERMEDIATE, max_position_embeddings=512,
    )  # fmt: skip
    outputs = generate(platform_target, plugin_manager_of(request.config), tmp_path, dtype_name, block_size)
    atol = get_tolerance(dtype_name).logits_atol
    for prompt, out in zip([LONG_PROMPT, PROMPTS[0]], outputs, strict=True):
        assert list(out.prompt_token_ids) == prompt, f"{CAPABILITY}: prompt ids changed"
        check_against_reference(model, prompt, out.outputs[0], atol)

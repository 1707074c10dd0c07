"""End to end: a tiny random Llama on the plugin generates HF transformers' greedy tokens, with its logprobs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import default_geometry
from engine_conformance.pytest_plugin import PlatformTarget, plugin_manager_of
from engine_plugin_sdk.tolerances import get_tolerance

PROMPTS = [
    [1, 5, 9, 33, 7],
    [1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 3],
    [1, 100],
]
MAX_TOKENS = 8
TOP_LOGPROBS = 3
VOCAB = 128


def build_tiny_llama(folder: Path, head_dim: int, seed: int = 0) -> Any:
    """Save a random two-layer Llama (GQA, untied head) and a word-level tokenizer; return the HF model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=4 * head_dim,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        # wide initial weights give peaked logits, so greedy choices are not near-ties decided by rounding
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def hf_greedy(model: Any, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's float64 log-softmax, straight from HF transformers."""
    ids = torch.tensor([prompt])
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(ids).logits[0, -1].double()
            step = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(step))
            tokens.append(token)
            logprobs.append(step)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


def engine_generate(
    platform_target: PlatformTarget, manager: Any, folder: Path, dtype: str, block_size: int
) -> list[Any]:
    """Run the prompts through the engine on this plugin's platform (the same path as ``engine.LLM``)."""
    try:
        from engine.config import CacheConfig, EngineConfig
        from engine.llm_engine import LLMEngine
        from engine.sampling.params import SamplingParams
    except ImportError as exc:
        pytest.skip(f"engine.LLM not available: {exc}")
    config = EngineConfig(
        model=str(folder), device=platform_target.name, dtype=dtype, cache=CacheConfig(block_size=block_size)
    )
    engine = LLMEngine.from_config(config, manager)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)
    return run_to_completion(engine, PROMPTS, params)


def run_to_completion(engine: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    """Step ``engine`` until every prompt's request finishes; their final outputs, in prompt order."""
    ids = [f"conformance-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    results: dict[str, Any] = {}
    while len(results) < len(ids):
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    return [results[rid] for rid in ids]


@pytest.mark.slow
@pytest.mark.capability("e2e.greedy")
def test_tiny_llama_matches_transformers(
    platform: Platform,
    caps: Capabilities,
    platform_target: PlatformTarget,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    geo = default_geometry(caps)
    # The most precise dtype the plugin claims; fp16 before bf16 (10 mantissa bits against 7).
    dtype_name = next((d for d in ("float32", "float16", "bfloat16") if d in caps.dtypes), caps.dtypes[0])
    model = build_tiny_llama(tmp_path, geo.head_size)
    outputs = engine_generate(
        platform_target, plugin_manager_of(request.config), tmp_path, dtype_name, geo.block_size
    )
    atol = get_tolerance(dtype_name).logits_atol
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected_tokens, expected_logprobs = hf_greedy(model, prompt)
        got = out.outputs[0]
        assert list(out.prompt_token_ids) == prompt, (
            f"e2e.greedy: prompt ids changed to {out.prompt_token_ids}"
        )
        assert got.logprobs is not None and len(got.logprobs) == MAX_TOKENS, (
            "e2e.logprobs: missing per-step logprobs"
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
                    f"e2e.greedy: prompt {prompt[:4]}... generated {list(got.token_ids)}, transformers "
                    f"{expected_tokens} (first difference at step {step}, top-2 margin {margin:.4f})"
                )
                compared = step + 1
                break
        for step, (reported, reference) in enumerate(zip(got.logprobs[:compared], expected_logprobs, strict=False)):
            for token_id, logprob in reported.items():
                want = float(reference[token_id])
                assert math.isclose(logprob.logprob, want, abs_tol=atol), (
                    f"e2e.logprobs: step {step} token {token_id}: logprob {logprob.logprob:.6f}, "
                    f"transformers {want:.6f} (atol {atol})"
                )

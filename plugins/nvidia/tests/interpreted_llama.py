"""A tiny Llama on this plugin for the engine-level tests: its engine settings, and its greedy tokens from
an eager engine (the reference the graph and overlap paths must equal), in the interpreter without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine_plugin_nvidia.platform import INTERPRET_ENV
from engine_plugin_sdk.testing import build_tiny_llama


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int = 5) -> list[list[int]]:
    """Each prompt's greedy tokens (EOS ignored)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def tiny_llama_reference(
    folder: Path, prompts: list[list[int]], max_num_seqs: int, num_layers: int = 2
) -> tuple[dict[str, object], list[list[int]]]:
    """Build the tiny Llama (head size 64, ``num_layers`` layers) in ``folder``: its ``LLM`` settings (float32,
    blocks of 16) and the eager engine's greedy tokens for ``prompts``."""
    build_tiny_llama(folder, head_dim=64, num_layers=num_layers)
    common = {"model": str(folder), "device": "cuda", "dtype": "float32", "block_size": 16, "max_num_seqs": max_num_seqs}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(INTERPRET_ENV, "1")
        return common, greedy_tokens(LLM(**common, enforce_eager=True), prompts)

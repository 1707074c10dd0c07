"""The installed example model plugin (GPT-NeoX) end to end: the engine finds it through its entry point and
generates the same greedy tokens as Hugging Face transformers."""

from __future__ import annotations

import importlib.metadata
import os
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.registry import ModelRegistry
from engine.plugins.manager import PluginManager

DISTRIBUTION = "engine-model-example"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3,",
    "A",
]
NEW_TOKENS = 16

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def example_plugin_installed() -> None:
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            f"the example model plugin is not installed: pip install --no-deps -e plugin_sdk/examples/model_plugin "
            f"(distribution {DISTRIBUTION}, installed by `make install-test`)"
        )


def save_tiny_gpt_neox(out_dir: str, tokenizer_dir: str, parallel_residual: bool, rotary_pct: float) -> str:
    """A random two-layer GPT-NeoX with SmolLM2's tokenizer (vocab 49152), weights widened so that greedy
    argmax is not a near-tie decided by rounding."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(2024 if parallel_residual else 2025)
    config = GPTNeoXConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rotary_pct=rotary_pct,
        rotary_emb_base=10000,
        use_parallel_residual=parallel_residual,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = GPTNeoXForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            else:  # LayerNorm scales
                param.normal_(1.0, 0.1)
    model.save_pretrained(out_dir)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return out_dir


def hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def test_the_entry_point_registers_gpt_neox() -> None:
    manager = PluginManager()
    record = next((r for r in manager.records if r.distribution == DISTRIBUTION), None)
    assert record is not None and record.status == "loaded", record
    registry = ModelRegistry.from_plugins(manager)
    model_class = registry.resolve("GPTNeoXForCausalLM", "test")
    assert model_class.__module__ == "engine_model_example.gpt_neox"
    assert registry.sources["GPTNeoXForCausalLM"] == record.name
    assert registry.refused == ()


@pytest.mark.parametrize("parallel_residual,rotary_pct", [(True, 0.25), (False, 0.5)])
def test_greedy_tokens_match_transformers_in_one_batch(
    tmp_path, hf_tokenizer_dir: str, parallel_residual: bool, rotary_pct: float
) -> None:
    from transformers import AutoModelForCausalLM

    path = save_tiny_gpt_neox(str(tmp_path), hf_tokenizer_dir, parallel_residual, rotary_pct)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # the engine ignores EOS below; HF must neither stop at it nor suppress it
    hf.generation_config.eos_token_id = None
    llm = LLM(model=path, device="cpu", dtype="float32", quantization="none", kv_cache_memory_bytes=32 << 20)
    assert type(llm.llm_engine.model).__name__ == "GPTNeoXForCausalLM"
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, NEW_TOKENS), prompt


def test_dummy_weights_follow_the_plugin_class(tmp_path, hf_tokenizer_dir: str) -> None:
    path = save_tiny_gpt_neox(str(tmp_path), hf_tokenizer_dir, True, 0.25)
    llm = LLM(model=path, device="cpu", dtype="float32", load_format="dummy", kv_cache_memory_bytes=32 << 20)
    out = llm.generate(
        ["Hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4

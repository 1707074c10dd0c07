"""Tiny seeded HF checkpoints of the dense architectures, and the engine-vs-transformers comparisons."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence

#: prompts of different lengths, most longer than the tiny windows (8 tokens) the configs set
PROMPTS = [
    "The capital of France is a city where many people live and work every day",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,",
    "A",
    "Paged attention stores the key value cache in fixed size blocks so that memory is not wasted on",
]

#: sizes shared by every tiny model (head size 32: the smallest the CPU plugin runs)
TINY = dict(
    vocab_size=49152,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def save_tiny(architecture: str, out_dir: str, tokenizer_dir: str, seed: int = 0, **overrides: Any) -> str:
    """Save a seeded random HF checkpoint of ``architecture`` with the tokenizer files copied in.

    Weights are drawn wider than HF's 0.02 so greedy argmax is not a near-tie; norm scales and biases
    are perturbed so their load path is exercised, and so are routers' correction biases.

    Args:
        architecture: a transformers ``*ForCausalLM`` class name.
        out_dir: the folder to write.
        tokenizer_dir: a HF tokenizer folder.
        seed: the torch seed.
        **overrides: config keys over :data:`TINY`.

    Returns:
        ``out_dir``.
    """
    import transformers

    model_cls = getattr(transformers, architecture)
    config = model_cls.config_class(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("sinks"):  # logits of the same order as the scores', so they take a share
                p.normal_(0.0, 1.0)
            else:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: it would not move any choice
                b.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return out_dir


def save_tiny_with_a_llama_tokenizer(architecture: str, folder: str, **overrides: Any) -> str:
    """:func:`save_tiny` into ``folder/model``, with the tokenizer of a tiny Llama built in ``folder/llama``
    (``engine_plugin_sdk.testing.build_tiny_llama``'s, head size 64: the GPU plugin's tests have no other).

    Returns:
        the checkpoint's folder.
    """
    from engine_plugin_sdk.testing import build_tiny_llama

    llama, tokenizer = os.path.join(folder, "llama"), os.path.join(folder, "tokenizer")
    build_tiny_llama(Path(llama), head_dim=64)
    os.makedirs(tokenizer, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(llama, name)):
            shutil.copy(os.path.join(llama, name), tokenizer)
    return save_tiny(architecture, os.path.join(folder, "model"), tokenizer, **overrides)


def load_hf(path: str) -> Any:
    """The HF model in float32 with eager attention (it honours soft-caps and windows)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def engine_prefill_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of every prompt token, the prompts run as one flat batch through the engine's runner."""
    engine = llm.llm_engine
    seqs = [
        Sequence(seq_id=20_000 + i, request_id=f"dense-{i}", index=0, prompt_token_ids=t, params=SamplingParams(), arrival=i)
        for i, t in enumerate(prompts)
    ]
    for s in seqs:
        engine.block_manager.allocate(s.seq_id, s.num_tokens)
    try:
        return engine.runner.prefill_logits(SchedulerOutput([ScheduledSequence.of(s, s.num_tokens) for s in seqs]))
    finally:
        for s in seqs:
            engine.block_manager.free(s.seq_id)


def max_logit_diff(llm: LLM, hf: Any, prompts: list[list[int]], fresh_hf: Callable[[], Any] | None = None) -> float:
    """The largest difference between the engine's and HF's prefill logits over every prompt position.

    Args:
        llm: the engine.
        hf: the HF model.
        prompts: token ids, run as one batch in the engine.
        fresh_hf: builds a new HF model for each prompt (HF's ``dynamic`` RoPE keeps the longest length it
            has seen; a fresh model runs each sequence alone).

    Returns:
        The largest absolute difference.
    """
    logits = engine_prefill_logits(llm, prompts)
    worst, offset = 0.0, 0
    for ids in prompts:
        model = fresh_hf() if fresh_hf is not None else hf
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        worst = max(worst, (logits[offset : offset + len(ids), : ref.shape[-1]] - ref).abs().max().item())
        offset += len(ids)
    return worst


def hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    """HF's greedy continuation of ``ids`` (``n`` tokens, EOS ignored)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()

"""Tiny random checkpoints for the GPU end-to-end checks (``*_gpu_check.py``): seeded, with the widened
weights the core's tests use (a flat next-token distribution would make greedy hinge on rounding), and a
tokenizer copied from a folder that holds one."""

from __future__ import annotations

import os
import shutil

import torch


def save_tiny(kind: str, out: str, tokenizer: str, seed: int, noise_of: str | None = None, num_layers: int = 2) -> str:
    """Save a tiny ``LlamaForCausalLM`` (``kind="llama"``) or ``Qwen2ForCausalLM`` of ``num_layers`` layers to
    ``out``; with ``noise_of``, that Llama folder plus noise on every matrix instead (a draft that agrees now
    and then).

    Returns:
        ``out``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)  # fmt: skip
    if noise_of is not None:
        model = LlamaForCausalLM.from_pretrained(noise_of, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.add_(torch.randn_like(p) * 0.03)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.08)
    model.save_pretrained(out)
    for name in os.listdir(tokenizer):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tokenizer, name), out)
    return out

"""Tiny PEFT LoRA adapters on a saved HF checkpoint, and the reference: HF with the adapter merged."""

from __future__ import annotations

from typing import Any

import torch

#: adapters of mixed ranks, targets and scalings (name -> PEFT LoraConfig keyword arguments)
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r4": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all-r16-rslora": dict(
        r=16, lora_alpha=8, use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),  # fmt: skip
    "pattern": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 32}),
    "embed-head": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "o_proj"]),
}


def save_adapter(base_dir: str, out_dir: str, seed: int, **lora_kwargs: Any) -> str:
    """Write a PEFT adapter for the checkpoint in ``base_dir`` with random, non-zero A and B.

    Returns:
        ``out_dir``.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                # large enough to move greedy tokens away from the base model's
                p.normal_(0.0, 0.15)
    model.save_pretrained(out_dir)
    return out_dir


def merged_hf(base_dir: str, adapter_dir: str | None) -> Any:
    """HF's model in float32 with the adapter merged into its weights (the base model for None)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager").eval()
    if adapter_dir is None:
        return base
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()

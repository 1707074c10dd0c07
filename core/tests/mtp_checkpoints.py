"""Tiny seeded DeepSeek-V3 checkpoints with a multi-token-prediction (MTP) layer added in the published
layout, and a torch reference of that layer's forward, for the MTP tests.

The published layout (DeepSeek-V3's ``model.layers.61.*``, ``num_nextn_predict_layers: 1``): ``enorm``,
``hnorm``, ``eh_proj`` ``[hidden, 2 * hidden]``, the decoder block's tensors under the same prefix,
``embed_tokens`` (a copy of the target's), ``shared_head.norm`` and ``shared_head.head``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from dense_model_utils import load_hf, save_tiny
from eagle_heads import load_target_tensors
from safetensors.torch import save_file

#: the tiny DeepSeek-V3 of test_dense_models (latent attention, a dense first layer, then experts)
DEEPSEEK = dict(
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, intermediate_size=64,
    q_lora_rank=48, kv_lora_rank=56, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, head_dim=8,
    num_key_value_heads=4,
)  # fmt: skip
#: the tiny GLM-4.5 of test_dense_models (q/k norms and q/k/v biases, a dense first layer, then experts)
GLM4_MOE = dict(
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, intermediate_size=64,
    use_qk_norm=True, attention_bias=True, pad_token_id=0,
)  # fmt: skip


def save_with_mtp(root: str, architecture: str, overrides: dict[str, Any], tokenizer_dir: str) -> tuple[str, str, str]:
    """A two-layer checkpoint (layer 1 experts) with an MTP layer (index 2: experts too), the one-layer
    model its block was drawn from, and the same target without the layer, under ``root``.

    Returns:
        ``(target, block, plain)`` folders.
    """
    plain = save_tiny(architecture, os.path.join(root, "plain"), tokenizer_dir, seed=3, **overrides)
    target = save_tiny(architecture, os.path.join(root, "target"), tokenizer_dir, seed=3, **overrides)
    one_layer = {**overrides, "num_hidden_layers": 1, "first_k_dense_replace": 0}
    block = save_tiny(architecture, os.path.join(root, "block"), tokenizer_dir, seed=4, **one_layer)
    return add_mtp_layer(target, block, seed=5), block, plain


def read_config(folder: str) -> dict[str, Any]:
    """A folder's ``config.json``."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def add_mtp_layer(
    target_dir: str, block_dir: str, seed: int = 0, tensors: dict[str, torch.Tensor] | None = None, shared_head: bool = True
) -> str:
    """Add an MTP layer to the checkpoint in ``target_dir`` (its weights rewritten, its config given
    ``num_nextn_predict_layers: 1``).

    Args:
        target_dir: the target's HF folder (one ``model.safetensors``).
        block_dir: a one-layer model of the target's architecture whose layer 0 is the MTP layer's block.
        seed: the seed of ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head``.
        tensors: MTP tensors (names after ``model.layers.{N}.``) written instead of the drawn ones.
        shared_head: store ``shared_head.*`` and ``embed_tokens`` (else the target's are used).

    Returns:
        ``target_dir``.
    """
    cfg = read_config(target_dir)
    n, h, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    weights = load_target_tensors(target_dir)
    mtp: dict[str, torch.Tensor] = {
        k.removeprefix("model.layers.0."): v for k, v in load_target_tensors(block_dir).items() if k.startswith("model.layers.0.")
    }
    mtp.update({
        "enorm.weight": 1.0 + torch.randn(h, generator=g) * 0.1,
        "hnorm.weight": 1.0 + torch.randn(h, generator=g) * 0.1,
        "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.08,
    })  # fmt: skip
    if shared_head:
        mtp.update({
            "embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
            "shared_head.norm.weight": 1.0 + torch.randn(h, generator=g) * 0.1,
            "shared_head.head.weight": torch.randn(vocab, h, generator=g) * 0.08,
        })  # fmt: skip
    mtp.update(tensors or {})
    weights.update({f"model.layers.{n}.{k}": v for k, v in mtp.items()})
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(target_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(target_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return target_dir


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_mtp(target_dir: str, block_dir: str, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer over one sequence of positions ``0 ..``, in float32: ``enorm`` / ``hnorm`` /
    ``eh_proj`` and the shared head written out, the decoder block transformers' (the one-layer model of
    ``block_dir`` with its final norm removed, so that its output is the block's residual stream).

    Args:
        target_dir: the target's folder with its MTP layer.
        block_dir: the one-layer model whose layer is the MTP layer's block.
        tokens: the token of each position (the target's next token).
        hidden: the target's hidden state at each position ``[n, hidden]``.

    Returns:
        The layer's output per position (the next position's hidden state) and its logits.
    """
    cfg = read_config(target_dir)
    w = {k: v.float() for k, v in load_target_tensors(target_dir).items()}
    p, eps = f"model.layers.{cfg['num_hidden_layers']}.", cfg["rms_norm_eps"]
    emb = w[p + "embed_tokens.weight"][torch.tensor(tokens)]
    emb[0] = 0  # the leading engine's mask of position 0
    x = torch.cat((_rms(emb, w[p + "enorm.weight"], eps), _rms(hidden.float(), w[p + "hnorm.weight"], eps)), -1)
    x = x @ w[p + "eh_proj.weight"].T
    block = load_hf(block_dir)
    block.model.norm = torch.nn.Identity()
    with torch.no_grad():
        out = block.model(inputs_embeds=x[None]).last_hidden_state[0]
    logits = _rms(out, w[p + "shared_head.norm.weight"], eps) @ w[p + "shared_head.head.weight"].T
    return out, logits

"""Tiny seeded EAGLE heads written in the published checkpoint layouts, and a hand-written torch reference
of their forward (the EAGLE authors' ``cnets1.py`` / ``cnets.py`` layer by layer), for the EAGLE tests."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def _target_config(target_dir: str) -> dict[str, Any]:
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def save_eagle_head(
    out_dir: str,
    target_dir: str,
    seed: int = 0,
    kind: str = "eagle",
    fc_bias: bool = True,
    draft_vocab_size: int | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    extra_config: dict[str, Any] | None = None,
) -> str:
    """Write an EAGLE head for the target in ``target_dir``: ``config.json`` and ``model.safetensors``.

    EAGLE-1 (``kind="eagle"``): ``fc.weight`` (``fc.bias``), ``layers.0.*`` without ``input_layernorm``,
    and the target's embeddings as the published heads store them. EAGLE-3: ``fc.weight`` over three
    hidden states, ``midlayer.*`` with ``hidden_norm`` and a ``2 * hidden``-wide attention input,
    ``norm.weight``, ``lm_head.weight`` over ``draft_vocab_size`` tokens, ``d2t`` and ``t2d``.

    Args:
        out_dir: the folder to write.
        target_dir: the target's HF folder (its sizes are the head's).
        seed: the weights' seed (normal, std 0.08; norm scales near one).
        kind: ``eagle`` or ``eagle3``.
        fc_bias: EAGLE-1: store ``fc.bias``.
        draft_vocab_size: EAGLE-3: the head's own vocabulary (the target's when None).
        tensors: tensors written instead of the drawn ones of the same name.
        extra_config: keys added to ``config.json``.

    Returns:
        ``out_dir``.
    """
    cfg = _target_config(target_dir)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    vocab = cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * 0.08

    def scale(n: int) -> torch.Tensor:
        return 1.0 + torch.randn(n, generator=g) * 0.1

    p = "layers.0." if kind == "eagle" else "midlayer."
    attn_in = h if kind == "eagle" else 2 * h
    out: dict[str, torch.Tensor] = {
        f"{p}self_attn.q_proj.weight": normal(heads * head_dim, attn_in),
        f"{p}self_attn.k_proj.weight": normal(kv_heads * head_dim, attn_in),
        f"{p}self_attn.v_proj.weight": normal(kv_heads * head_dim, attn_in),
        f"{p}self_attn.o_proj.weight": normal(h, heads * head_dim),
        f"{p}mlp.gate_proj.weight": normal(inter, h),
        f"{p}mlp.up_proj.weight": normal(inter, h),
        f"{p}mlp.down_proj.weight": normal(h, inter),
        f"{p}post_attention_layernorm.weight": scale(h),
    }
    head_cfg = {**cfg, "num_hidden_layers": 1}
    if kind == "eagle":
        out["fc.weight"] = normal(h, 2 * h)
        if fc_bias:
            out["fc.bias"] = torch.randn(h, generator=g) * 0.1
        target = load_target_tensors(target_dir)
        out["embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
        head_cfg.update(architectures=["LlamaForCausalLM"], bias=fc_bias)
    else:
        draft = draft_vocab_size or vocab
        out.update({
            "fc.weight": normal(h, 3 * h),
            f"{p}input_layernorm.weight": scale(h),
            f"{p}hidden_norm.weight": scale(h),
            "norm.weight": scale(h),
            "lm_head.weight": normal(draft, h),
        })  # fmt: skip
        # the draft vocabulary: every other target id from 0, stored as offsets (target id - draft id)
        ids = torch.arange(draft) * (vocab // draft if draft < vocab else 1)
        out["d2t"] = ids - torch.arange(draft)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
        head_cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft)
    out.update(tensors or {})
    head_cfg.update(extra_config or {})
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(head_cfg, f)
    return out_dir


def load_target_tensors(target_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a (sharded or not) safetensors HF folder."""
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(target_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(target_dir, name)))
    return tensors


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1).float(), torch.cat((angles.sin(), angles.sin()), -1).float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None]


def reference_head(
    head_dir: str, embed: torch.Tensor, lm_head: torch.Tensor, tokens: list[int], hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over one sequence of positions ``0 ..``, in float32, written out from the architecture.

    Args:
        head_dir: the head's folder.
        embed: the target's embeddings (EAGLE-1 and EAGLE-3 heads without their own).
        lm_head: the target's LM head (EAGLE-1).
        tokens: the token of each position (the target's next token).
        hidden: each position's hidden state ``[n, hidden]`` (EAGLE-3: ``[n, 3 * hidden]`` is put through
            ``fc`` first).

    Returns:
        The head's output per position (the next position's hidden state) and its logits over the
        target's vocabulary.
    """
    cfg = _target_config(head_dir)
    w = load_file(os.path.join(head_dir, "model.safetensors"))
    w = {k: (v.float() if v.is_floating_point() else v) for k, v in w.items()}
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    h = cfg["hidden_size"]
    d = cfg.get("head_dim") or h // heads
    eagle3 = "midlayer.hidden_norm.weight" in w
    p = "midlayer." if eagle3 else "layers.0."
    n = len(tokens)
    emb = embed.float()[torch.tensor(tokens)]
    if eagle3:
        if hidden.shape[-1] != h:
            hidden = hidden.float() @ w["fc.weight"].T
        residual = hidden
        x = torch.cat((_rms(emb, w[p + "input_layernorm.weight"], eps), _rms(hidden, w[p + "hidden_norm.weight"], eps)), -1)
    else:
        x = torch.cat((emb, hidden.float()), -1) @ w["fc.weight"].T
        if "fc.bias" in w:
            x = x + w["fc.bias"]
        residual = x
    positions = torch.arange(n)
    q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d), positions, theta)
    k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, d), positions, theta)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    stream = residual + attn @ w[p + "self_attn.o_proj.weight"].T
    y = _rms(stream, w[p + "post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    out = stream + mlp
    if not eagle3:
        return out, out @ lm_head.float().T
    draft_logits = _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T
    logits = torch.full((n, embed.shape[0]), float("-inf"))
    logits[:, torch.arange(draft_logits.shape[-1]) + w["d2t"]] = draft_logits
    return out, logits

"""Mixture-of-experts pieces of the contract: routing (the ``moe_topk`` op) and the experts' weights and
combine (:meth:`GemmBackend.prepare_experts` / :meth:`GemmBackend.fused_moe`), with the core's torch
implementations, which any backend may keep (they run on whatever device the tensors are on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from engine.interfaces.gemm import GemmBackend

#: the gated activation of every expert's MLP: ``silu`` (SwiGLU: Mixtral, Qwen MoE, OLMoE, DeepSeek)
MoeActivation = Literal["silu"]


@dataclass(slots=True)
class ExpertWeights:
    """Every expert's projections, each prepared by the backend's :meth:`GemmBackend.prepare_weight`
    (the default form of :meth:`GemmBackend.prepare_experts`).

    Attributes:
        gate_up: per expert, ``[2 * intermediate, hidden]``: the gate's rows, then the up projection's.
        down: per expert, ``[hidden, intermediate]``.
    """

    gate_up: list[Any]
    down: list[Any]

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)


def moe_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: each token's ``top_k`` experts and their weights.

    Args:
        router_logits: ``[tokens, experts]`` (any float dtype; scored in float32).
        top_k: experts per token.
        renormalize: scale each token's chosen weights to sum to 1 (Mixtral, Qwen3-MoE); otherwise they
            keep their softmax probabilities (Qwen2-MoE, OLMoE).

    Returns:
        float32 weights ``[tokens, top_k]`` and int64 expert ids ``[tokens, top_k]``, highest first.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int64)


def reference_fused_moe(
    gemm: GemmBackend,
    x: torch.Tensor,
    experts: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: MoeActivation = "silu",
) -> torch.Tensor:
    """The experts' weighted sum through ``gemm.linear``, one pair of calls per expert that has tokens.

    Args:
        gemm: the backend whose :meth:`~GemmBackend.linear` runs each expert's projections.
        x: ``[tokens, hidden]`` activations.
        experts: from :meth:`GemmBackend.prepare_experts`'s default.
        topk_weights: float32 ``[tokens, k]``.
        topk_ids: int64 ``[tokens, k]`` expert ids (a token may name one expert twice).
        activation: the experts' gated activation.

    Returns:
        ``[tokens, hidden]`` in ``x``'s dtype: ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])``.
    """
    if activation != "silu":
        raise ValueError(f"unknown expert activation {activation!r}")
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1, 1).float()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    # one sort by expert, then contiguous runs: a few small host reads instead of one per expert
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        tokens = token_of[rows]
        gate_up = gemm.linear(x.index_select(0, tokens), experts.gate_up[expert])
        inter = gate_up.shape[-1] // 2
        hidden = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
        y = gemm.linear(hidden, experts.down[expert])
        out.index_add_(0, tokens, y.float() * flat_weights[rows])
    return out.to(x.dtype)

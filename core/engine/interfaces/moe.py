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

#: the gated activation of every expert's MLP: ``silu`` (SwiGLU: Mixtral, Qwen MoE, OLMoE, DeepSeek) or
#: ``swigluoai`` (gpt-oss: the gate clamped at 7 and passed through ``g * sigmoid(1.702 g)``, the up half
#: clamped to [-7, 7] and shifted by one)
MoeActivation = Literal["silu", "swigluoai"]
#: gpt-oss's SwiGLU constants (``swiglu_alpha``, ``swiglu_limit``)
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0
#: how router logits become expert scores
MoeScoring = Literal["softmax", "sigmoid"]
#: how a group of experts is scored for group-limited routing
MoeGroupScore = Literal["top2", "max"]


@dataclass(slots=True)
class ExpertWeights:
    """Every expert's projections, each prepared by the backend's :meth:`GemmBackend.prepare_weight`
    (the default form of :meth:`GemmBackend.prepare_experts`).

    Attributes:
        gate_up: per expert, ``[2 * intermediate, hidden]``: the gate's rows, then the up projection's.
        down: per expert, ``[hidden, intermediate]``.
        gate_up_bias: per expert ``[2 * intermediate]`` (gpt-oss), None without biases.
        down_bias: per expert ``[hidden]``, None without biases.
    """

    gate_up: list[Any]
    down: list[Any]
    gate_up_bias: list[Any] | None = None
    down_bias: list[Any] | None = None

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)


def moe_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: MoeScoring = "softmax",
    correction_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    scaling: float = 1.0,
    group_score: MoeGroupScore = "top2",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing: each token's ``top_k`` experts and their weights.

    Args:
        router_logits: ``[tokens, experts]`` (any float dtype; scored in float32).
        top_k: experts per token.
        renormalize: scale each token's chosen weights to sum to 1 (Mixtral, Qwen3-MoE); otherwise they
            keep their scores (Qwen2-MoE, OLMoE).
        scoring: ``"softmax"`` over the experts, or ``"sigmoid"`` per expert (DeepSeek-V3, GLM-4.5).
        correction_bias: float32 ``[experts]`` added to the scores to *choose* experts (the weights stay
            the unbiased scores), or None.
        num_groups: experts fall into this many equal groups, and only the ``topk_groups`` best groups'
            experts may be chosen.
        topk_groups: groups a token may choose from.
        scaling: a factor on the final weights (``routed_scaling_factor``).
        group_score: a group's score: ``"top2"``, the sum of its two best (biased) scores (DeepSeek-V3),
            or ``"max"``, its best (DeepSeek-V2's ``group_limited_greedy``).

    Returns:
        float32 weights ``[tokens, top_k]`` and int64 expert ids ``[tokens, top_k]``, best first (by the
        biased score).

    Raises:
        ValueError: for an unknown scoring or groups that do not divide the experts.
    """
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"unknown MoE scoring {scoring!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        tokens, experts = choice.shape
        if experts % num_groups:
            raise ValueError(f"{experts} experts do not fall into {num_groups} equal groups")
        grouped = choice.view(tokens, num_groups, -1)
        group_scores = grouped.amax(dim=-1) if group_score == "max" else grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(experts // num_groups, dim=1), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, ids.to(torch.int64)


def expert_activation(gate_up: torch.Tensor, activation: MoeActivation) -> torch.Tensor:
    """An expert's gated activation of its ``[rows, 2 * intermediate]`` gate/up product (gate columns first).

    Raises:
        ValueError: for an unknown activation.
    """
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "swigluoai":
        gate = gate.clamp(max=SWIGLUOAI_LIMIT)
        up = up.clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA))
    raise ValueError(f"unknown expert activation {activation!r}")


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
    if activation not in ("silu", "swigluoai"):
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
        gate_up_bias = experts.gate_up_bias[expert] if experts.gate_up_bias is not None else None
        down_bias = experts.down_bias[expert] if experts.down_bias is not None else None
        gate_up = gemm.linear(x.index_select(0, tokens), experts.gate_up[expert], gate_up_bias)
        y = gemm.linear(expert_activation(gate_up, activation), experts.down[expert], down_bias)
        out.index_add_(0, tokens, y.float() * flat_weights[rows])
    return out.to(x.dtype)

"""A mixture of experts for decode-sized batches on the CPU: the routing read once, each chosen expert's two
products through the plugin's kernels, and its rows added to the output one by one.

The SDK's per-expert product sorts the slots on the device and adds each expert's rows with ``index_add_``,
which costs about 80 us a call on two cores with passive OpenMP waits, eight times a token and layer: more
than the products of a small expert. Here everything is already in host memory, so the routing is read as
Python lists and a row add costs a few microseconds. Batches past :data:`FEW_TOKENS` take the SDK's path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine_plugin_sdk import expert_activation, reference_fused_moe

if TYPE_CHECKING:
    from engine_plugin_sdk import ExpertWeights, GemmBackend

#: most tokens in a batch that take the row-by-row path (a prompt's chunk takes the SDK's)
FEW_TOKENS = 16


def fused_moe_few_tokens(
    gemm: GemmBackend, x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    activation: str = "silu", gated: Any = None,
) -> torch.Tensor:  # fmt: skip
    """``GemmBackend.fused_moe`` for a few tokens, else the SDK's :func:`reference_fused_moe`.

    Args:
        gemm: the backend whose ``linear`` runs each expert's products.
        x: ``[tokens, hidden]`` activations.
        experts: the experts as ``prepare_experts`` returned them.
        topk_weights: float32 ``[tokens, k]``.
        topk_ids: int64 ``[tokens, k]`` (an expert may appear twice for one token).
        activation: the experts' gated activation.
        gated: a faster SiLU-and-mul for ``[rows, 2 * inter]`` products, or None for the SDK's.

    Returns:
        ``[tokens, hidden]`` in ``x``'s dtype.
    """
    if x.shape[0] > FEW_TOKENS:
        return reference_fused_moe(gemm, x, experts, topk_weights, topk_ids, activation)
    slots: dict[int, list[tuple[int, float]]] = {}
    for token, (ids, weights) in enumerate(zip(topk_ids.tolist(), topk_weights.tolist())):
        for expert, weight in zip(ids, weights):
            slots.setdefault(expert, []).append((token, weight))
    out = torch.zeros(x.shape, dtype=torch.float32)
    for expert, rows in slots.items():
        first = rows[0][0]
        inputs = x[first : first + 1] if len(rows) == 1 else x[[token for token, _ in rows]]
        gate_up_bias = experts.gate_up_bias[expert] if experts.gate_up_bias is not None else None
        down_bias = experts.down_bias[expert] if experts.down_bias is not None else None
        projected = gemm.linear(inputs, experts.gate_up[expert], gate_up_bias)
        hidden = gated(projected) if gated is not None and activation == "silu" else expert_activation(projected, activation)
        y = gemm.linear(hidden, experts.down[expert], down_bias)
        for row, (token, weight) in enumerate(rows):
            out[token].add_(y[row], alpha=weight)
    return out.to(x.dtype)

"""Experts stored stacked in one tensor per projection (transformers' gpt-oss layout), plain or MXFP4,
turned into the per-expert ``[2 * inter, hidden]`` gate/up and ``[hidden, inter]`` down matrices that
:meth:`GemmBackend.prepare_experts` takes.

The stacked gate/up interleaves its outputs: gate ``j`` is output ``2j``, up ``j`` is output ``2j + 1``;
the loader splits them into the gate-then-up halves every backend's fused MoE expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.loader.lazy_tensor import materialize
from engine.loader.mxfp4 import MXFP4_BLOCK, dequantize_mxfp4
from engine.loader.weight_slices import weight_rows
from engine.models.layers.spec import MoeSpec

if TYPE_CHECKING:
    from engine.models.layers.layer_loader import LayerLoader


@dataclass(slots=True)
class ExpertMatrices:
    """One rank's experts as matrices in the model dtype, on the CPU (biases None without them)."""

    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    gate_up_bias: list[torch.Tensor] | None
    down_bias: list[torch.Tensor] | None


def stacked_expert_shapes(spec: MoeSpec, hidden: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """The stacked experts' tensors by HF name (``prefix`` is the layer's)."""
    e, inter, p = spec.num_experts, spec.intermediate_size, prefix + spec.expert
    if spec.layout == "stacked_mxfp4":
        shapes = {
            p + "gate_up_proj_blocks": (e, 2 * inter, hidden // MXFP4_BLOCK, MXFP4_BLOCK // 2),
            p + "gate_up_proj_scales": (e, 2 * inter, hidden // MXFP4_BLOCK),
            p + "down_proj_blocks": (e, hidden, inter // MXFP4_BLOCK, MXFP4_BLOCK // 2),
            p + "down_proj_scales": (e, hidden, inter // MXFP4_BLOCK),
        }
    else:
        shapes = {p + "gate_up_proj": (e, hidden, 2 * inter), p + "down_proj": (e, inter, hidden)}
    if spec.expert_bias:
        shapes.update({p + "gate_up_proj_bias": (e, 2 * inter), p + "down_proj_bias": (e, hidden)})
    return shapes


def load_stacked_experts(
    loader: LayerLoader, prefix: str, spec: MoeSpec, own_experts: range, own_width: slice, adds_down_bias: bool
) -> ExpertMatrices:
    """Take a layer's stacked experts out of the checkpoint, keeping this rank's share.

    Args:
        loader: the model's layer loader.
        prefix: the layer's HF prefix.
        spec: the layer's mixture of experts.
        own_experts: the experts this rank holds.
        own_width: the slice of each expert's intermediate width this rank holds.
        adds_down_bias: this rank adds the down projections' biases (the ranks' outputs are summed, so
            only one of the ranks that split an expert's width may).

    Returns:
        The rank's experts.
    """
    model, p = loader.model, prefix + spec.expert
    shapes = stacked_expert_shapes(spec, model.config.hidden_size, prefix)
    # read only this rank's experts (whole, as the interleaved gate/up columns make a width slice strided)
    experts = slice(own_experts.start, own_experts.stop)
    taken = {
        name[len(p):]: materialize(weight_rows(loader.take(name, shape, lazy_ok=True), experts))
        for name, shape in shapes.items()
    }
    if spec.layout == "stacked_mxfp4":
        # the blocks are already [experts, out, in]
        gate_up = dequantize_mxfp4(taken["gate_up_proj_blocks"], taken["gate_up_proj_scales"], model.dtype)
        down = dequantize_mxfp4(taken["down_proj_blocks"], taken["down_proj_scales"], model.dtype)
    else:
        gate_up = taken["gate_up_proj"].transpose(1, 2)
        down = taken["down_proj"].transpose(1, 2)
    gate_ups = [torch.cat([w[0::2][own_width], w[1::2][own_width]]).contiguous() for w in gate_up]
    downs = [w[:, own_width].contiguous() for w in down]
    gate_up_bias = down_bias = None
    if spec.expert_bias:
        gate_up_bias = [torch.cat([b[0::2][own_width], b[1::2][own_width]]) for b in taken["gate_up_proj_bias"]]
        down_bias = [b if adds_down_bias else torch.zeros_like(b) for b in taken["down_proj_bias"]]
    return ExpertMatrices(gate_ups, downs, gate_up_bias, down_bias)

"""The mixture-of-experts MLP of a decoder layer: a router, the experts (run by the GEMM backend's
``fused_moe``) and an optional shared expert with its sigmoid gate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.loader.quantized import concat_weights
from engine.models.layers.spec import MoeSpec

if TYPE_CHECKING:
    from engine.models.layers.blocks import LayerLoader
    from engine.models.layers.decoder import DenseDecoder


@dataclass(slots=True)
class MoeMLP:
    """One layer's loaded mixture of experts.

    Attributes:
        router: the router matrix ``[experts, hidden]``, prepared by the GEMM backend.
        experts: the experts, from :meth:`GemmBackend.prepare_experts`.
        top_k: experts per token.
        renormalize: scale the chosen experts' weights to sum to 1.
        shared_gate_up: the shared expert's fused gate/up, None without one.
        shared_down: its down projection.
        shared_gate: its sigmoid gate ``[1, hidden]``, None when its output is added as it is.
        spec: the layer's routing (scoring, groups, scaling).
        correction_bias: float32 ``[experts]`` added to the scores to choose, None without one.
    """

    router: Any
    experts: Any
    top_k: int
    renormalize: bool
    shared_gate_up: Any = None
    shared_down: Any = None
    shared_gate: Any = None
    spec: MoeSpec | None = None
    correction_bias: torch.Tensor | None = None

    def forward(self, model: DenseDecoder, x: torch.Tensor) -> torch.Tensor:
        """Route, run the chosen experts and combine them (plus the gated shared expert)."""
        gemm = model.gemm
        logits = gemm.linear(x, self.router)
        spec = self.spec
        if spec is None or (spec.scoring == "softmax" and spec.num_groups == 1 and self.correction_bias is None):
            weights, ids = model.ops.moe_topk(logits, self.top_k, self.renormalize)
        else:
            weights, ids = model.ops.moe_topk(
                logits, self.top_k, self.renormalize, spec.scoring, self.correction_bias, spec.num_groups,
                spec.topk_groups, spec.routed_scaling_factor,
            )  # fmt: skip
        out = gemm.fused_moe(x, self.experts, weights, ids)
        if self.shared_gate_up is not None:
            shared = gemm.linear(model.ops.silu_and_mul(gemm.linear(x, self.shared_gate_up)), self.shared_down)
            if self.shared_gate is not None:
                shared = torch.sigmoid(gemm.linear(x, self.shared_gate)) * shared
            out = out + shared
        return out


def moe_weight_shapes(spec: MoeSpec, hidden: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """A MoE layer's tensors by HF name (``prefix`` is the layer's)."""
    gate, up, down = spec.expert_projections
    inter = spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {prefix + spec.router + ".weight": (spec.num_experts, hidden)}
    if spec.correction_bias is not None:
        shapes[prefix + spec.correction_bias] = (spec.num_experts,)
    for e in range(spec.num_experts):
        p = prefix + spec.expert.format(e)
        shapes[p + gate + ".weight"] = (inter, hidden)
        shapes[p + up + ".weight"] = (inter, hidden)
        shapes[p + down + ".weight"] = (hidden, inter)
    if spec.shared_intermediate_size is not None:
        p, shared = prefix + spec.shared_expert, spec.shared_intermediate_size
        shapes.update({
            p + "gate_proj.weight": (shared, hidden), p + "up_proj.weight": (shared, hidden),
            p + "down_proj.weight": (hidden, shared),
        })  # fmt: skip
        if spec.shared_expert_gate is not None:
            shapes[prefix + spec.shared_expert_gate + ".weight"] = (1, hidden)
    return shapes


def load_moe(loader: LayerLoader, prefix: str, spec: MoeSpec) -> MoeMLP:
    """Take a MoE layer's tensors out of the checkpoint (``prefix`` is the layer's HF prefix)."""
    model = loader.model
    hidden, inter = model.config.hidden_size, spec.intermediate_size
    gate, up, down = spec.expert_projections
    gate_ups, downs = [], []
    for e in range(spec.num_experts):
        p = prefix + spec.expert.format(e)
        gate_ups.append(concat_weights([loader.take(p + gate + ".weight", (inter, hidden)), loader.take(p + up + ".weight", (inter, hidden))]))
        downs.append(loader.take(p + down + ".weight", (hidden, inter)))
    device = model.device
    experts = model.gemm.prepare_experts(
        [w.to(device) if isinstance(w, torch.Tensor) else w for w in gate_ups],
        [w.to(device) if isinstance(w, torch.Tensor) else w for w in downs],
        model.dtype,
    )
    # the router stays in the model dtype under load-time quantization: it picks the experts
    router = loader.matrix(loader.take(prefix + spec.router + ".weight", (spec.num_experts, hidden)), projection=False)
    moe = MoeMLP(router=router, experts=experts, top_k=spec.top_k, renormalize=spec.renormalize, spec=spec)
    if spec.correction_bias is not None:
        bias = loader.take(prefix + spec.correction_bias, (spec.num_experts,))
        moe.correction_bias = torch.as_tensor(bias).to(device=device, dtype=torch.float32)
    if spec.shared_intermediate_size is not None:
        p, shared = prefix + spec.shared_expert, spec.shared_intermediate_size
        moe.shared_gate_up = loader.matrix(concat_weights([
            loader.take(p + "gate_proj.weight", (shared, hidden)), loader.take(p + "up_proj.weight", (shared, hidden)),
        ]))  # fmt: skip
        moe.shared_down = loader.matrix(loader.take(p + "down_proj.weight", (hidden, shared)))
        if spec.shared_expert_gate is not None:
            moe.shared_gate = loader.matrix(loader.take(prefix + spec.shared_expert_gate + ".weight", (1, hidden)), projection=False)
    return moe

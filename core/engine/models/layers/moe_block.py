"""The mixture-of-experts MLP of a decoder layer: a router, the experts (run by the GEMM backend's
``fused_moe``) and an optional shared expert with its sigmoid gate; under tensor parallelism each rank holds
a slice of every expert or, with expert parallelism, whole experts of its own, and the ranks' outputs are
summed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.loader.lazy_tensor import materialize
from engine.loader.quantized import concat_weights
from engine.loader.weight_slices import weight_columns, weight_rows
from engine.models.layers.spec import MoeSpec
from engine.models.layers.stacked_experts import ExpertMatrices, load_stacked_experts, stacked_expert_shapes

if TYPE_CHECKING:
    from engine.models.layers.blocks import PendingNorm
    from engine.models.layers.decoder import DenseDecoder
    from engine.models.layers.layer_loader import LayerLoader


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
        expert_start: under expert parallelism, the first of this rank's experts (None otherwise).
        local_experts: how many experts this rank holds under expert parallelism.
        router_bias: the router's bias in the model dtype, None without one.
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
    expert_start: int | None = None
    local_experts: int = 0
    router_bias: torch.Tensor | None = None

    def forward(self, model: DenseDecoder, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        """Route, run the chosen experts and combine them (plus the gated shared expert); ``x`` a
        :class:`~engine.models.layers.blocks.PendingNorm` where the router's product takes the norm before it."""
        gemm = model.gemm
        if isinstance(x, torch.Tensor):
            logits = gemm.linear(x, self.router, self.router_bias)
        else:
            logits, x = x.route(model, self.router, self.router_bias)
        spec = self.spec
        plain = spec is None or (spec.num_groups == 1 and spec.routed_scaling_factor == 1.0)
        if plain and (spec is None or spec.scoring == "softmax") and self.correction_bias is None:
            weights, ids = model.ops.moe_topk(logits, self.top_k, self.renormalize)
        else:
            weights, ids = model.ops.moe_topk(
                logits, self.top_k, self.renormalize, spec.scoring, self.correction_bias, spec.num_groups,
                spec.topk_groups, spec.routed_scaling_factor, spec.group_score,
            )  # fmt: skip
        if self.expert_start is not None:
            # this rank's experts only: the others' choices weigh nothing here (the ranks' sum has them)
            local = ids - self.expert_start
            mine = (local >= 0) & (local < self.local_experts)
            weights, ids = weights * mine, local.clamp(0, self.local_experts - 1)
        if spec is None or spec.activation == "silu":
            out = gemm.fused_moe(x, self.experts, weights, ids)
        else:
            out = gemm.fused_moe(x, self.experts, weights, ids, spec.activation)
        if self.shared_gate_up is not None:
            if "silu" in gemm.gated_activations:
                # the backend's gate/up product with its activation in one (at batch 1 one GEMV launch, not two)
                act = gemm.gated_linear(x, self.shared_gate_up, "silu")
            else:
                act = model.ops.silu_and_mul(gemm.linear(x, self.shared_gate_up))
            shared = gemm.linear(act, self.shared_down)
            if self.shared_gate is not None:
                shared = torch.sigmoid(gemm.linear(x, self.shared_gate)) * shared
            out = out + shared
        return out if model.tp is None else model.tp.reduce(out)


def moe_weight_shapes(spec: MoeSpec, hidden: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """A MoE layer's tensors by HF name (``prefix`` is the layer's)."""
    gate, up, down = spec.expert_projections
    inter = spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {prefix + spec.router + ".weight": (spec.num_experts, hidden)}
    if spec.router_bias:
        shapes[prefix + spec.router + ".bias"] = (spec.num_experts,)
    if spec.correction_bias is not None:
        shapes[prefix + spec.correction_bias] = (spec.num_experts,)
    if spec.layout != "per_expert":
        shapes.update(stacked_expert_shapes(spec, hidden, prefix))
    for e in range(spec.num_experts if spec.layout == "per_expert" else 0):
        p = prefix + spec.expert.format(e)
        shapes[p + gate + ".weight"] = (inter, hidden)
        shapes[p + up + ".weight"] = (inter, hidden)
        shapes[p + down + ".weight"] = (hidden, inter)
        if spec.expert_bias:
            shapes.update({p + gate + ".bias": (inter,), p + up + ".bias": (inter,), p + down + ".bias": (hidden,)})
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
    """Take a MoE layer's tensors out of the checkpoint (``prefix`` is the layer's HF prefix).

    Under tensor parallelism a rank keeps its share: its slice of every expert's (and the shared expert's)
    intermediate width, or, under expert parallelism, its own experts whole (the others are dropped unread).
    """
    model, tp = loader.model, loader.model.tp
    hidden, inter = model.config.hidden_size, spec.intermediate_size
    gate, up, down = spec.expert_projections
    lazy = tp is not None
    own_experts = range(spec.num_experts)
    own_width = slice(0, inter)
    if tp is not None and tp.expert_parallel:
        rows = tp.rows(spec.num_experts)
        own_experts = range(rows.start, rows.stop)
    elif tp is not None:
        own_width = tp.rows(inter)
    # every expert-parallel rank adds its own experts' down biases; width-split ranks leave them to rank 0
    adds_down_bias = tp is None or tp.expert_parallel or tp.rank == 0
    if spec.layout == "per_expert":
        gate_ups, downs, gate_up_biases, down_biases = [], [], [], []
        for e in range(spec.num_experts):
            p = prefix + spec.expert.format(e)
            parts = [loader.take(p + gate + ".weight", (inter, hidden), lazy), loader.take(p + up + ".weight", (inter, hidden), lazy)]
            down_weight = loader.take(p + down + ".weight", (hidden, inter), lazy)
            if spec.expert_bias:
                gate_bias, up_bias = (torch.as_tensor(loader.take(p + name + ".bias", (inter,))) for name in (gate, up))
                down_bias = torch.as_tensor(loader.take(p + down + ".bias", (hidden,)))
            if e not in own_experts:
                continue
            gate_ups.append(concat_weights([materialize(weight_rows(part, own_width)) for part in parts]))
            downs.append(_contiguous(materialize(weight_columns(down_weight, own_width))))
            if spec.expert_bias:
                gate_up_biases.append(torch.cat([gate_bias[own_width], up_bias[own_width]]))
                down_biases.append(down_bias if adds_down_bias else torch.zeros_like(down_bias))
        biased = spec.expert_bias
        matrices = ExpertMatrices(gate_ups, downs, gate_up_biases if biased else None, down_biases if biased else None)
    else:
        matrices = load_stacked_experts(loader, prefix, spec, own_experts, own_width, adds_down_bias)
    device = model.device
    biases = [
        None if part is None else [b.to(device=device, dtype=model.dtype) for b in part]
        for part in (matrices.gate_up_bias, matrices.down_bias)
    ]
    experts = model.gemm.prepare_experts(
        [w.to(device) if isinstance(w, torch.Tensor) else w for w in matrices.gate_up],
        [w.to(device) if isinstance(w, torch.Tensor) else w for w in matrices.down],
        model.dtype,
        *biases,
    )
    # the router stays in the model dtype under load-time quantization: it picks the experts
    router = loader.matrix(loader.take(prefix + spec.router + ".weight", (spec.num_experts, hidden)), projection=False)
    moe = MoeMLP(router=router, experts=experts, top_k=spec.top_k, renormalize=spec.renormalize, spec=spec)
    if spec.router_bias:
        bias = loader.take(prefix + spec.router + ".bias", (spec.num_experts,))
        moe.router_bias = torch.as_tensor(bias).to(device=device, dtype=model.dtype)
    if tp is not None and tp.expert_parallel:
        moe.expert_start, moe.local_experts = own_experts.start, len(own_experts)
    if spec.correction_bias is not None:
        bias = loader.take(prefix + spec.correction_bias, (spec.num_experts,))
        moe.correction_bias = torch.as_tensor(bias).to(device=device, dtype=torch.float32)
    if spec.shared_intermediate_size is not None:
        p, shared = prefix + spec.shared_expert, spec.shared_intermediate_size
        width = slice(0, shared) if tp is None else tp.rows(shared)
        parts = [loader.take(p + "gate_proj.weight", (shared, hidden), lazy), loader.take(p + "up_proj.weight", (shared, hidden), lazy)]
        moe.shared_gate_up = loader.matrix(concat_weights([materialize(weight_rows(part, width)) for part in parts]))
        shared_down = loader.take(p + "down_proj.weight", (hidden, shared), lazy)
        moe.shared_down = loader.matrix(_contiguous(materialize(weight_columns(shared_down, width))))
        if spec.shared_expert_gate is not None:
            moe.shared_gate = loader.matrix(loader.take(prefix + spec.shared_expert_gate + ".weight", (1, hidden)), projection=False)
    return moe


def moe_tensor_parallel_problems(spec: MoeSpec, size: int, expert_parallel: bool) -> list[str]:
    """Why a mixture of experts cannot split ``size`` ways (empty when it can)."""
    problems = []
    if expert_parallel and spec.num_experts % size:
        problems.append(f"{spec.num_experts} experts do not divide among {size} expert-parallel ranks")
    if not expert_parallel and spec.intermediate_size % size:
        problems.append(f"expert width {spec.intermediate_size} does not split over tensor_parallel_size {size}")
    if spec.shared_intermediate_size is not None and spec.shared_intermediate_size % size:
        problems.append(f"shared expert width {spec.shared_intermediate_size} does not split over tensor_parallel_size {size}")
    return problems


def _contiguous(weight: Any) -> Any:
    # a column slice is a strided view; a quantized weight stays as it is
    return weight.contiguous() if isinstance(weight, torch.Tensor) else weight

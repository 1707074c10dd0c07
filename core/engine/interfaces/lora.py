"""Batched LoRA in the contract: every row of a flat batch may run under its own adapter.

The engine keeps a fixed number of adapter *slots* on the device. Each projection that adapters target
holds one :class:`LoraWeights`: the slots' ``A`` and ``B`` matrices stacked, zero-padded to one rank, and
a scale per slot. A step names each row's slot (``-1``: the base model only) in a :class:`LoraStep`; the
backend plans the step once (:meth:`GemmBackend.plan_lora`) and then adds every targeted projection's
update with :meth:`GemmBackend.add_lora`:

    ``y[t] += scales[s] * (x[t] @ a[s].T) @ b[s].T`` for ``s = token_slots[t] >= 0``

("shrink" to the rank, then "expand" to the output). A fused projection (q/k/v, gate/up) stacks its
parts' ``A`` matrices along the rank and places their ``B`` matrices block-diagonally, so one call
covers it. The torch implementation here runs on any device; a backend may replace it with kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LoraWeights:
    """One projection's adapters, one per device slot.

    Attributes:
        a: ``[slots, rank, in_features]``; rows past an adapter's own rank are zero.
        b: ``[slots, out_features, rank]``; columns past an adapter's own rank are zero.
        scales: float32 ``[slots]``, each adapter's ``lora_alpha / r`` (or ``/ sqrt(r)`` for rsLoRA); 0 for
            an empty slot.
    """

    a: torch.Tensor
    b: torch.Tensor
    scales: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.a.shape[0]

    @property
    def rank(self) -> int:
        return self.a.shape[1]


@dataclass(frozen=True, slots=True)
class LoraStep:
    """Which adapter slot each row of a step reads.

    Attributes:
        token_slots: int32 ``[rows]`` on the model's device; ``-1`` for a row without an adapter.
        token_slots_cpu: the same values on the host, or None where they must not be read there (a step
            being recorded into a graph: the plan must then use only ``token_slots``).
        num_slots: the engine's slot count (``max_loras``); every value is below it.
    """

    token_slots: torch.Tensor
    token_slots_cpu: tuple[int, ...] | None
    num_slots: int


@dataclass(slots=True)
class GroupedLoraRows:
    """The default plan of a step: its rows grouped by slot, each group padded to one width.

    Attributes:
        slots: int64 ``[groups]``, the slots of the groups; None when the groups are every slot in order
            (then the weights are used as they are, without gathering the slots present).
        rows: int64 ``[groups * width]``, each group's row indices, padded with row 0.
        valid: ``[groups * width, 1]`` float32, 1 for a real row and 0 for padding.
        width: rows per group after padding.
        gather: int64 ``[rows]``: where each row's update is in the groups' flat output (a row without an
            adapter points at a padding row, whose update is zero).
    """

    slots: torch.Tensor | None
    rows: torch.Tensor
    valid: torch.Tensor
    width: int
    gather: torch.Tensor


def group_lora_rows(step: LoraStep) -> GroupedLoraRows | None:
    """The default :meth:`GemmBackend.plan_lora`: rows grouped by slot, or None when no row has one.

    Reads the slots on the host (from ``token_slots_cpu``, else by copying ``token_slots``), so it is not
    for a step being recorded into a graph.
    """
    values = step.token_slots_cpu
    if values is None:
        values = tuple(step.token_slots.tolist())
    groups: dict[int, list[int]] = {}
    for row, slot in enumerate(values):
        if slot >= 0:
            groups.setdefault(slot, []).append(row)
    if not groups:
        return None
    # more than half the slots present: pad the absent ones rather than gather the present ones' weights
    every = 2 * len(groups) > step.num_slots
    order = list(range(step.num_slots)) if every else sorted(groups)
    # one padding row at least where some row has no adapter: that row's update is read from it
    width = max(len(rows) for rows in groups.values()) + (len(values) > sum(len(r) for r in groups.values()))
    flat: list[int] = []
    valid: list[float] = []
    gather = [width - 1] * len(values)
    for index, slot in enumerate(order):
        rows = groups.get(slot, [])
        for position, row in enumerate(rows):
            gather[row] = index * width + position
        flat += rows + [0] * (width - len(rows))
        valid += [1.0] * len(rows) + [0.0] * (width - len(rows))
    device = step.token_slots.device
    return GroupedLoraRows(
        slots=None if every else torch.tensor(order, dtype=torch.int64, device=device),
        rows=torch.tensor(flat, dtype=torch.int64, device=device),
        valid=torch.tensor(valid, dtype=torch.float32, device=device).unsqueeze(1),
        width=width,
        gather=torch.tensor(gather, dtype=torch.int64, device=device),
    )


def grouped_add_lora(y: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: GroupedLoraRows | None) -> None:
    """The default :meth:`GemmBackend.add_lora` on a :func:`group_lora_rows` plan: one batched product per
    stage for all of the step's adapters, in the adapters' dtype, then each row's update gathered back."""
    if plan is None:
        return
    a, b, scales = weights.a, weights.b, weights.scales
    if plan.slots is not None:
        a, b, scales = a.index_select(0, plan.slots), b.index_select(0, plan.slots), scales.index_select(0, plan.slots)
    groups = a.shape[0]
    xs = x.index_select(0, plan.rows).view(groups, plan.width, -1).to(a.dtype)
    shrunk = torch.bmm(xs, a.transpose(1, 2))
    # padding rows become zero here, so the rows without an adapter gather a zero update
    weight = scales.view(groups, 1, 1) * plan.valid.view(groups, plan.width, 1)
    shrunk = (shrunk.float() * weight).to(b.dtype)
    out = torch.bmm(shrunk, b.transpose(1, 2)).view(groups * plan.width, -1)
    y.add_(out.index_select(0, plan.gather).to(y.dtype))


def reference_add_lora(y: torch.Tensor, x: torch.Tensor, weights: LoraWeights, token_slots: torch.Tensor) -> torch.Tensor:
    """The contract's meaning, row by row in float64: returns ``y`` plus every row's adapter update.

    Args:
        y: ``[rows, out_features]`` (unchanged; the result is a new float64 tensor).
        x: ``[rows, in_features]``.
        weights: the projection's slots.
        token_slots: int ``[rows]``; ``-1`` adds nothing.

    Returns:
        float64 ``[rows, out_features]``.
    """
    out = y.double().clone()
    for row, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        shrunk = x[row].double() @ weights.a[slot].double().T
        out[row] += float(weights.scales[slot]) * (shrunk @ weights.b[slot].double().T)
    return out


"""Grouped-integer experts kept in their codes on a GPU: GPTQ / AWQ / compressed-tensors int4 or int8 experts and
GGUF's experts of the types :mod:`engine_plugin_sdk.grouped_codes` repacks, each expert packed as a dense grouped
weight is (:func:`~engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing.pack_grouped_int`), then stacked with a
leading expert dimension for the MoE kernels (:mod:`~engine_plugin_sdk.gpu.triton_kernels.moe_grouped_int_kernels`).

A Qwen3-30B-A3B's experts hold 29 G weights: 58 GB in bf16, 15 GB as 4-bit codes with their scales.

The experts of one projection must share a packed form for one kernel to read them all; where they do not (one
expert's scales exact in float16, another's not; one with a single zero point, another with zero scales), all of
them take the widest form, which stands for the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.interfaces.gemm import QuantizedWeight
from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.grouped_codes import grouped_form

#: the pairing block of 4-bit codes at most (any power of two the group allows serves the MoE kernels)
EXPERT_BLOCK_K = 128


@dataclass(slots=True)
class GroupedIntExperts:
    """One MoE layer's experts as stacked grouped-integer weights.

    Attributes:
        gate_up: ``shape`` ``(2 * inter, hidden)``; its tensors ``[E, ...]`` (:class:`GroupedIntWeight`'s layout).
        down: ``shape`` ``(hidden, inter)``.
        gate_up_bias: ``[E, 2 * inter]``, None without biases.
        down_bias: ``[E, hidden]``, None without biases.
    """

    gate_up: GroupedIntWeight
    down: GroupedIntWeight
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.gate_up.codes.shape[0])


def stack_grouped_int(weights: list[Any], device: torch.device, two_level: bool = True) -> GroupedIntWeight | None:
    """Pack and stack one projection's experts, or None where they are not all grouped-integer weights of one
    form (bits, group size, shape) whose group size allows a packing block.

    Args:
        weights: per expert, a :class:`QuantizedWeight` (or anything else, which gives None).
        device: where the stack goes.
        two_level: keep GGUF's K-quants' two-level scales where every expert has them.

    Returns:
        A :class:`GroupedIntWeight` whose tensors have a leading expert dimension, or None.
    """
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import grouped_int_block_k, pack_grouped_int

    if not weights or not all(isinstance(w, QuantizedWeight) for w in weights):
        return None
    forms = {(grouped_form(w), tuple(w.shape)) for w in weights}
    if len(forms) != 1:
        return None
    form, _ = forms.pop()
    if form is None:
        return None
    bits, group = form
    block_k = grouped_int_block_k(group, bits, EXPERT_BLOCK_K)
    if block_k is None:
        return None
    packed = [pack_grouped_int(w, block_k, device, two_level=two_level, six_bit=False) for w in weights]
    if len({_param_form(p) for p in packed}) != 1:
        if two_level and any(p.sub_groups for p in packed):
            return stack_grouped_int(weights, device, two_level=False)
        packed = _widest(packed)
    return _stacked(packed)


def _param_form(w: GroupedIntWeight) -> tuple:
    """What one kernel launch fixes about a packed weight's parameters."""
    dtypes = tuple(None if t is None else t.dtype for t in (w.scales, w.zero_scales, w.super_scales, w.super_zero_scales))
    return w.bits, w.block_k, w.sub_groups, w.zero_point if w.zero_scales is None else None, w.perm is None, dtypes


def _widest(packed: list[GroupedIntWeight]) -> list[GroupedIntWeight]:
    """One-level weights in one form: float32 scales, zero scales for all where one has them, a permutation for
    all where one has it (the identity elsewhere)."""
    zero_scales = len({p.zero_point if p.zero_scales is None else None for p in packed}) > 1
    perm = any(p.perm is not None for p in packed)
    out = []
    for p in packed:
        scales = p.scales.float()
        zs = None if p.zero_scales is None else p.zero_scales.float()
        if zero_scales and zs is None:
            # (code - zero) * scale = code * scale - zero * scale
            zs = scales * float(p.zero_point)
        order = p.perm
        if perm and order is None:
            order = torch.arange(p.shape[1], dtype=torch.int32, device=p.codes.device)
        out.append(replace(p, scales=scales, zero_scales=zs, perm=order, zero_point=0 if zs is not None else p.zero_point))
    return out


def _stacked(packed: list[GroupedIntWeight]) -> GroupedIntWeight:
    first = packed[0]

    def stack(name: str) -> torch.Tensor | None:
        parts = [getattr(p, name) for p in packed]
        return None if parts[0] is None else torch.stack(parts).contiguous()

    return replace(
        first, codes=stack("codes"), scales=stack("scales"), zero_scales=stack("zero_scales"), perm=stack("perm"),
        super_scales=stack("super_scales"), super_zero_scales=stack("super_zero_scales"), high_bits=None,
    )  # fmt: skip

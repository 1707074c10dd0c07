"""Mixture-of-experts weights in the form the shared Triton kernels read: every expert of a layer stacked in
one tensor per projection (:mod:`engine_plugin_sdk.gpu.triton_kernels.moe_launchers`).

FP8 e4m3 experts (per-channel or per-tensor scales) stay FP8 where the GPU reads the OCP format; every
other quantized scheme is dequantized to the model dtype at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.interfaces.gemm import QuantizedWeight

FP8_SCHEME = "fp8_e4m3"


@dataclass(slots=True)
class StackedExperts:
    """One MoE layer's experts, stacked.

    Attributes:
        gate_up: ``[E, 2 * inter, hidden]``: each expert's gate rows, then its up rows.
        down: ``[E, hidden, inter]``.
        gate_up_scale: float32 ``[E, 2 * inter]`` per-channel scales when ``gate_up`` is FP8, else None.
        down_scale: float32 ``[E, hidden]`` when ``down`` is FP8, else None.
        gate_up_bias: ``[E, 2 * inter]`` (gpt-oss), None without biases.
        down_bias: ``[E, hidden]``, None without biases.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.gate_up.shape[0])


def stack_experts(
    gate_up: list[Any], down: list[Any], dtype: torch.dtype, device: torch.device, fp8: bool,
    gate_up_bias: list[Any] | None = None, down_bias: list[Any] | None = None,
) -> StackedExperts:  # fmt: skip
    """Stack a layer's experts on ``device``.

    Args:
        gate_up: per expert ``[2 * inter, hidden]``: float tensors or :class:`QuantizedWeight`.
        down: per expert ``[hidden, inter]``.
        dtype: the model's activation dtype (what unquantized experts are stored in).
        device: where the stacks go.
        fp8: keep ``fp8_e4m3`` experts in FP8 (the GPU reads ``float8_e4m3fn``).
        gate_up_bias: per expert ``[2 * inter]``, or None.
        down_bias: per expert ``[hidden]``, or None.

    Raises:
        ValueError: for experts of different shapes, or a quantized expert that cannot be dequantized.
    """
    gate_up_data, gate_up_scale = _stack(gate_up, dtype, device, fp8)
    down_data, down_scale = _stack(down, dtype, device, fp8)
    return StackedExperts(
        gate_up_data, down_data, gate_up_scale, down_scale, _stack_biases(gate_up_bias, dtype, device),
        _stack_biases(down_bias, dtype, device),
    )  # fmt: skip


def _stack_biases(biases: list[Any] | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    if biases is None:
        return None
    return torch.stack([torch.as_tensor(b) for b in biases]).to(device=device, dtype=dtype).contiguous()


def _stack(weights: list[Any], dtype: torch.dtype, device: torch.device, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    shapes = {tuple(w.shape) for w in weights}
    if len(shapes) != 1:
        raise ValueError(f"experts of one projection must share a shape, got {sorted(shapes)}")
    if fp8 and all(isinstance(w, QuantizedWeight) and w.scheme == FP8_SCHEME for w in weights):
        out_features = weights[0].shape[0]
        data = torch.stack([torch.as_tensor(w.data).to(device) for w in weights])
        if data.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8_e4m3 expert data must be float8_e4m3fn, got {data.dtype}")
        scales = [torch.as_tensor(w.extra.get("scale", 1.0), dtype=torch.float32).reshape(-1) for w in weights]
        scale = torch.stack([s.expand(out_features) if s.numel() == 1 else s for s in scales]).to(device)
        if tuple(scale.shape) != (len(weights), out_features):
            raise ValueError(f"fp8_e4m3 expert scales must hold 1 or {out_features} values each")
        return data.contiguous(), scale.contiguous()
    dense = torch.empty((len(weights), *shapes.pop()), dtype=dtype, device=device)
    for i, w in enumerate(weights):
        dense[i].copy_(_dense(w))
    return dense, None


def _dense(weight: Any) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        from engine_plugin_sdk.gpu.gemm import dequantize_checked

        return dequantize_checked(weight)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise ValueError(f"cannot prepare an expert weight of type {type(weight).__name__}; expected a float tensor")
    return weight

"""GEMM through torch on the NPU; quantized weights are dequantized once at load time."""

from __future__ import annotations

from typing import Any

import torch

from engine_plugin_sdk import GemmBackend, QuantizedWeight, torch_dtype


class AscendGemmBackend(GemmBackend):
    """``torch.nn.functional.linear`` on device-resident weights (torch_npu dispatches it to the cube units).

    No scheme is kept quantized: torch_npu's weight-quantized matmuls are not wired in yet, so every
    :class:`QuantizedWeight` goes through its own ``dequantize()``.

    Args:
        device: where prepared weights live.
    """

    supported_quant_schemes: frozenset[str] = frozenset()

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare_weight(self, weight: Any, dtype: Any) -> torch.Tensor:
        target = torch_dtype(dtype)
        if isinstance(weight, QuantizedWeight):
            if weight.dequantize is None:
                raise ValueError(
                    f"quantized weight of scheme {weight.scheme!r} has no dequantize() to fall back to"
                )
            dense = weight.dequantize()
            if not isinstance(dense, torch.Tensor) or tuple(dense.shape) != tuple(weight.shape):
                raise ValueError(
                    f"dequantize() of scheme {weight.scheme!r} did not return a tensor of shape {tuple(weight.shape)}"
                )
            weight = dense
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise ValueError(
                f"cannot prepare a weight of type {type(weight).__name__}; expected a float tensor"
            )
        return weight.to(device=self.device, dtype=target).contiguous()

    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> torch.Tensor:
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return torch.nn.functional.linear(x, weight, bias)

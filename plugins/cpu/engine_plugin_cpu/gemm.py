"""Dense GEMM on the CPU; quantized weights are dequantized once at load time."""

from __future__ import annotations

from typing import Any

import torch

from engine.interfaces.gemm import GemmBackend, QuantizedWeight
from engine_plugin_cpu.platform import torch_dtype


class CpuGemmBackend(GemmBackend):
    """``torch.nn.functional.linear`` over weights cast to the model dtype.

    No scheme is kept quantized yet (packed int8/int4 kernels come later), so every
    :class:`QuantizedWeight` goes through its own ``dequantize()``.
    """

    supported_quant_schemes: frozenset[str] = frozenset()

    def prepare_weight(self, weight: Any, dtype: Any) -> torch.Tensor:
        target = torch_dtype(dtype)
        if isinstance(weight, QuantizedWeight):
            if weight.dequantize is None:
                raise ValueError(
                    f"quantized weight of scheme {weight.scheme!r} has no dequantize() to fall back to"
                )
            dense = weight.dequantize()
            if not isinstance(dense, torch.Tensor):
                raise ValueError(
                    f"dequantize() of scheme {weight.scheme!r} returned {type(dense).__name__}, expected a tensor"
                )
            if tuple(dense.shape) != tuple(weight.shape):
                raise ValueError(
                    f"dequantize() of scheme {weight.scheme!r} returned shape {tuple(dense.shape)}, "
                    f"expected {tuple(weight.shape)}"
                )
            weight = dense
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"cannot prepare a weight of type {type(weight).__name__}; expected a tensor")
        if not weight.is_floating_point():
            raise ValueError(
                f"cannot prepare an unquantized weight of dtype {weight.dtype}; expected floating point"
            )
        # contiguous so that every linear() hits the fast BLAS layout without a hidden copy
        return weight.to(device="cpu", dtype=target).contiguous()

    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)

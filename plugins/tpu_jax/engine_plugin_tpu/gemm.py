"""GEMM with ``jnp.dot``: bf16 (or fp32) operands, fp32 accumulation, weights stored ``[in, out]``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from engine_plugin_sdk import GemmBackend, QuantizedWeight
from engine_plugin_tpu.arrays import jax_dtype, to_jax, to_torch


def matmul(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``x @ weight (+ bias)`` with ``weight`` ``[in, out]``, accumulated in fp32, returned in x's dtype.

    fp32 operands ask for full precision: a TPU would otherwise run fp32 matmuls in bf16 passes.
    """
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out = jnp.dot(x, weight.astype(x.dtype), precision=precision, preferred_element_type=jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(x.dtype)


_matmul_jit = jax.jit(matmul)


class JaxGemmBackend(GemmBackend):
    """Dense GEMM on JAX; quantized weights are dequantized once at load (none is kept packed yet).

    :meth:`prepare_weight` returns a JAX array ``[in_features, out_features]`` (transposed once, so that
    every matmul contracts the weight's leading axis, the layout the TPU's MXU reads best).
    :meth:`linear` accepts torch tensors or JAX arrays and answers in the kind it was given.
    """

    supported_quant_schemes: frozenset[str] = frozenset()

    def prepare_weight(self, weight: Any, dtype: Any) -> jax.Array:
        target = jax_dtype(dtype)
        if isinstance(weight, QuantizedWeight):
            if weight.dequantize is None:
                raise ValueError(f"quantized weight of scheme {weight.scheme!r} has no dequantize() to fall back to")
            dense = weight.dequantize()
            if tuple(dense.shape) != tuple(weight.shape):
                raise ValueError(
                    f"dequantize() of scheme {weight.scheme!r} returned shape {tuple(dense.shape)}, "
                    f"expected {tuple(weight.shape)}"
                )
            weight = dense
        if isinstance(weight, torch.Tensor):
            if not weight.is_floating_point():
                raise ValueError(f"cannot prepare an unquantized weight of dtype {weight.dtype}; expected floating point")
            weight = to_jax(weight.detach().float().cpu().contiguous())
        elif not isinstance(weight, jax.Array):
            raise ValueError(f"cannot prepare a weight of type {type(weight).__name__}; expected a tensor or JAX array")
        if weight.ndim != 2:
            raise ValueError(f"a weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        return jnp.asarray(weight.T, dtype=target)

    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> Any:
        if x.shape[-1] != weight.shape[0]:
            raise ValueError(f"x has {x.shape[-1]} features, the weight expects {weight.shape[0]}")
        out = _matmul_jit(to_jax(x), weight, None if bias is None else to_jax(bias))
        return to_torch(out) if isinstance(x, torch.Tensor) else out

"""The CPU's overrides of the small ops: fewer tensor ops per call than the references.

At batch 1 a decode step is a few hundred tiny ops, each costing mostly its dispatch, so these cut the
count: RMSNorm through torch's fused ``rms_norm``, and the rotary embedding of query and key in one pass
over both (they are neighbouring column ranges of the fused q/k/v projection). Both compute in float32
like the references and return the input dtype.

Where the plugin's C kernels are loaded (:class:`NativeOps`), bf16 calls take one C call each instead:
RMSNorm with or without the residual add, LayerNorm with the residual add (an encoder's post-norms, rows
split over torch's OpenMP team), SiLU-and-mul, and the rotary embedding of query and key together when
they are neighbouring heads of one fused q/k/v row (as the core's Llama passes them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine_plugin_cpu.token_bitmask import apply_token_bitmask
from engine_plugin_sdk import silu_and_mul

if TYPE_CHECKING:
    from engine_plugin_cpu.native_kernels import NativeKernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` in float32, returned in x's dtype."""
    if x.dtype == weight.dtype:
        # torch's CPU kernel already computes bf16 in float32 (bit-identical on 2.4M random values),
        # and one op instead of three saves ~3 us of dispatch per call, 60 calls a token
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return out.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm in float32, returned in x's dtype: torch's one CPU kernel (it accumulates bf16 in float32)
    where the dtypes agree, instead of the reference's six elementwise passes (a BERT step spent more time
    in those than in its attention)."""
    if x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    out = torch.nn.functional.layer_norm(
        x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps
    )
    return out.to(x.dtype)


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """:func:`layer_norm` of ``x + residual``, the sum in x's dtype (a BERT block's residual connection)."""
    return layer_norm(x + residual, weight, bias, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def post_norm_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The branch's post-norm, then :func:`fused_add_rms_norm` (the CPU has no launch cost to save by
    fusing further: two passes over a row that stays in cache)."""
    return fused_add_rms_norm(rms_norm(x, post_weight, eps), residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of query ``[T, H, D]`` and key ``[T, KVH, D]`` in one pass."""
    num_heads = query.shape[1]
    cs = cos_sin_cache.index_select(0, positions)
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    both = torch.cat((query, key), dim=1).float()
    x1, x2 = both[..., :half], both[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if query.dtype == key.dtype:
        rotated = rotated.to(query.dtype)
        return rotated[:, :num_heads], rotated[:, num_heads:]
    return rotated[:, :num_heads].to(query.dtype), rotated[:, num_heads:].to(key.dtype)


class NativeOps:
    """The ops above through the C kernels for contiguous bf16 inputs; the torch versions otherwise.

    Args:
        native: the loaded kernels.
    """

    def __init__(self, native: NativeKernels) -> None:
        self.native = native

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.native.accepts(x, weight) and weight.numel() == x.shape[-1]:
            return self.native.rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            self.native.accepts(x, weight)
            and residual.dtype in (torch.bfloat16, torch.float32)
            and residual.is_contiguous()
            and x.shape == residual.shape
            and weight.numel() == x.shape[-1]
        ):
            # the residual stream stays in float32 between layers (the core only passes it back here)
            return self.native.add_rms_norm_f32(x, residual, weight, eps)
        out, summed = fused_add_rms_norm(x, residual, weight, eps)
        # a float32 residual from an earlier layer must not turn the activations into float32
        return out.to(x.dtype), summed

    def post_norm_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The native post-norm, then the native fused add and norm."""
        return self.fused_add_rms_norm(self.rms_norm(x, post_weight, eps), residual, weight, eps)

    def add_layer_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        """One pass over each row (sum, statistics, normalisation) instead of torch's add and then its norm:
        a BERT step's two post-norms a layer, 8,192 rows of bge-small, 0.9 ms each against 1.6."""
        if (
            self.native.accepts(x, residual, weight)
            and (bias is None or self.native.accepts(bias))
            and x.shape == residual.shape
            and weight.numel() == x.shape[-1]
            and (bias is None or bias.numel() == x.shape[-1])
        ):
            return self.native.add_layer_norm(x, residual, weight, bias, eps)
        return add_layer_norm(x, residual, weight, bias, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native.accepts(x) and x.shape[-1] % 2 == 0:
            return self.native.silu_and_mul(x)
        return silu_and_mul(x)

    def rotary_embedding(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._adjacent_heads(query, key) or cos_sin_cache.dtype != torch.float32:
            return rotary_embedding(positions, query, key, cos_sin_cache)
        if positions.dtype != torch.int64 or not positions.is_contiguous() or not cos_sin_cache.is_contiguous():
            return rotary_embedding(positions, query, key, cos_sin_cache)
        num_heads = query.shape[1]
        rotated = self.native.rotary(query, num_heads + key.shape[1], positions, cos_sin_cache)
        return rotated[:, :num_heads], rotated[:, num_heads:]

    @staticmethod
    def _adjacent_heads(query: torch.Tensor, key: torch.Tensor) -> bool:
        """Query ``[T, H, D]`` and key ``[T, KVH, D]`` are bf16 views of one row with the key heads next."""
        if query.dtype != torch.bfloat16 or key.dtype != torch.bfloat16 or query.device.type != "cpu":
            return False
        if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
            return False
        t, h, d = query.shape
        if query.stride()[1:] != (d, 1) or key.stride()[1:] != (d, 1):
            return False
        # a single row's stride is arbitrary (and never read)
        if t > 1 and (query.stride(0) != key.stride(0) or query.stride(0) < (h + key.shape[1]) * d):
            return False
        return key.data_ptr() == query.data_ptr() + h * d * query.element_size()


def cpu_op_overrides(native: NativeKernels | None = None) -> dict[str, Callable[..., Any]]:
    """The op table entries this platform replaces, by name."""
    if native is not None:
        ops = NativeOps(native)
        return {
            "rms_norm": ops.rms_norm,
            "layer_norm": layer_norm,
            "add_layer_norm": ops.add_layer_norm,
            "fused_add_rms_norm": ops.fused_add_rms_norm,
            "post_norm_add_rms_norm": ops.post_norm_add_rms_norm,
            "rotary_embedding": ops.rotary_embedding,
            "silu_and_mul": ops.silu_and_mul,
            "apply_token_bitmask": apply_token_bitmask,
        }
    return {
        "rms_norm": rms_norm,
        "layer_norm": layer_norm,
        "add_layer_norm": add_layer_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "post_norm_add_rms_norm": post_norm_add_rms_norm,
        "rotary_embedding": rotary_embedding,
        "apply_token_bitmask": apply_token_bitmask,
    }

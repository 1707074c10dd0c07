"""The model's small ops through torch_npu's fused kernels: RMSNorm, add + RMSNorm, rotary, SwiGLU.

Each function adapts the core's op signature (:mod:`engine.interfaces.ops`) to the kernel's: casting
the norm weight to the activation dtype the kernels require, and expanding the core's ``[cos | sin]``
cache into the ``r1``/``r2`` tensors ``npu_rotary_mul`` broadcasts over a BSND ``[1, T, N, D]`` input.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch


class AscendOps:
    """The op overrides of one platform instance, bound to its kernel module.

    Args:
        kernels: the kernel module.
    """

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels
        # every layer of a step rotates by the same positions: expand cos/sin once per step
        self._rotary_key: tuple[torch.Tensor, torch.Tensor, torch.dtype] | None = None
        self._rotary_value: tuple[torch.Tensor, torch.Tensor] | None = None

    def overrides(self) -> dict[str, Callable[..., Any]]:
        """The ops by name, for :meth:`engine.interfaces.ops.OpTable.with_overrides`."""
        return {
            "rms_norm": self.rms_norm,
            "fused_add_rms_norm": self.fused_add_rms_norm,
            "rotary_embedding": self.rotary_embedding,
            "silu_and_mul": self.silu_and_mul,
        }

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out, _ = self.kernels.rms_norm(x, weight.to(x.dtype), eps)
        return out

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual.dtype != x.dtype:
            residual = residual.to(x.dtype)
        out, _, summed = self.kernels.add_rms_norm(x, residual, weight.to(x.dtype), eps)
        return out, summed

    def rotary_embedding(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = query.shape[-1]
        if cos_sin_cache.shape[-1] != head_dim or key.shape[-1] != head_dim:
            raise ValueError(
                f"rotary on npu rotates whole heads: cos/sin width {cos_sin_cache.shape[-1]}, "
                f"query head_dim {head_dim}, key head_dim {key.shape[-1]} must agree"
            )
        if query.dtype != key.dtype:
            raise ValueError(
                f"query ({query.dtype}) and key ({key.dtype}) must share a dtype for rotary on npu"
            )
        r1, r2 = self._cos_sin(positions, cos_sin_cache, query.dtype)
        # BSND with B = 1 and S = tokens: r1/r2 are [1, T, 1, D], the 1S1D broadcast the kernel documents
        q = self.kernels.rotary_mul(query.unsqueeze(0).contiguous(), r1, r2).squeeze(0)
        k = self.kernels.rotary_mul(key.unsqueeze(0).contiguous(), r1, r2).squeeze(0)
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.swiglu(x.contiguous(), dim=-1)

    def _cos_sin(
        self, positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = self._rotary_key
        if key is not None and key[0] is positions and key[1] is cos_sin_cache and key[2] == dtype:
            assert self._rotary_value is not None
            return self._rotary_value
        cs = cos_sin_cache.index_select(0, positions.to(device=cos_sin_cache.device, dtype=torch.long))
        half = cs.shape[-1] // 2
        cos, sin = cs[:, :half], cs[:, half:]
        # rotate-half pairs element i with i + d/2, so both halves use the same angle
        r1 = torch.cat((cos, cos), dim=-1).to(dtype).view(1, -1, 1, 2 * half)
        r2 = torch.cat((sin, sin), dim=-1).to(dtype).view(1, -1, 1, 2 * half)
        self._rotary_key = (positions, cos_sin_cache, dtype)
        self._rotary_value = (r1, r2)
        return r1, r2

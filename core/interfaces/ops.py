"""Small named ops with reference torch implementations; a platform may override any of them by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32, returned in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``; the sum is the next residual.

    The normalised output has ``x``'s dtype. The sum may be returned in float32 instead (a platform
    override may keep the residual stream in float32 to avoid a rounding per layer); the model only
    passes it back as the next call's ``residual``, so such an override gets its own float32 back.
    """
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their positions, rotate-half (GPT-NeoX / HF Llama) convention.

    Args:
        positions: int64 ``[num_tokens]``.
        query: ``[num_tokens, num_heads, head_dim]``.
        key: ``[num_tokens, num_kv_heads, head_dim]``.
        cos_sin_cache: float32 ``[max_position, head_dim]``: cos in the first half, sin in the second.

    Returns:
        The rotated query and key, in their input dtypes.
    """
    cs = cos_sin_cache.index_select(0, positions)
    half = cs.shape[-1] // 2
    cos = cs[:, :half].unsqueeze(1)
    sin = cs[:, half:].unsqueeze(1)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        tf = t.float()
        t1, t2 = tf[..., :half], tf[..., half:]
        return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1).to(t.dtype)

    return rotate(query), rotate(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate/up projection of width ``2d``."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


@dataclass(frozen=True, slots=True)
class OpTable:
    """The op implementations a model calls; start from :func:`reference_ops` and override by name."""

    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]

    def with_overrides(self, overrides: dict[str, Callable]) -> OpTable:
        """A copy with some ops replaced.

        Raises:
            ValueError: for a name that is not an op.
        """
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown op name(s) {unknown}; known ops: {sorted(known)}")
        return replace(self, **overrides)


OP_NAMES = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")


def reference_ops() -> OpTable:
    """The reference torch implementations."""
    return OpTable(
        rms_norm=rms_norm,
        fused_add_rms_norm=fused_add_rms_norm,
        rotary_embedding=rotary_embedding,
        silu_and_mul=silu_and_mul,
    )

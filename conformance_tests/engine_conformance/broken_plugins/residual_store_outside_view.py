"""Broken: ``fused_add_rms_norm`` stores the new residual in place with stride-blind addresses.

Imitates an in-place fused kernel (vLLM's writes the sum back into ``residual``) that computes store
addresses as ``row * width + col``: its return values are right, and so is a contiguous residual, but a
residual that is a slice of a wider buffer gets its neighbours overwritten.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.interfaces.ops import fused_add_rms_norm
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


def stride_blind_store_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, summed = fused_add_rms_norm(x, residual, weight, eps)
    dense = torch.empty(residual.shape, device="meta").stride()
    residual.as_strided(residual.shape, dense, residual.storage_offset()).copy_(summed)
    return normed, summed


class ResidualStorePlatform(ReferencePlatform):
    name = "broken-residual-store"

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        return {"fused_add_rms_norm": stride_blind_store_add_rms_norm}


@hookimpl
def engine_register_platforms() -> list[type]:
    return [ResidualStorePlatform]

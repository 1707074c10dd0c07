"""Broken: the fused add + LayerNorm normalises ``x`` alone and forgets the residual.

Imitates a backend that wires its plain LayerNorm kernel to the fused op's name: right only when the
residual happens to be zero, wrong for every real BERT block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.interfaces.ops import layer_norm
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


def residual_dropped(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    return layer_norm(x, weight, bias, eps)


class ResidualDroppedPlatform(ReferencePlatform):
    name = "broken-add-layer-norm"

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        return {"add_layer_norm": residual_dropped}


@hookimpl
def engine_register_platforms() -> list[type]:
    return [ResidualDroppedPlatform]

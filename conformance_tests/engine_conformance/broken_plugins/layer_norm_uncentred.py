"""Broken: LayerNorm skips subtracting the mean (it normalises like RMSNorm, then adds the bias).

Imitates a backend that reuses its RMSNorm kernel for LayerNorm models: right whenever rows happen to
have a zero mean, wrong for real activations with an offset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


def uncentred_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class UncentredLayerNormPlatform(ReferencePlatform):
    name = "broken-layer-norm"

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        return {"layer_norm": uncentred_layer_norm}


@hookimpl
def engine_register_platforms() -> list[type]:
    return [UncentredLayerNormPlatform]

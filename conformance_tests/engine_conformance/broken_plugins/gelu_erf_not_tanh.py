"""Broken: ``gelu_tanh_and_mul`` uses the exact (erf) GELU instead of the tanh approximation.

Imitates the Gemma activation slip (``gelu`` vs ``gelu_pytorch_tanh``): the two curves differ by at most
about 1e-3, so bfloat16 outputs are within tolerance and only float32 shows it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


def erf_gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    gate = torch.nn.functional.gelu(x[..., :d].float())  # approximate="none"
    return (gate * x[..., d:].float()).to(x.dtype)


class ErfGeluPlatform(ReferencePlatform):
    name = "broken-gelu"

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        return {"gelu_tanh_and_mul": erf_gelu_and_mul}


@hookimpl
def engine_register_platforms() -> list[type]:
    return [ErfGeluPlatform]

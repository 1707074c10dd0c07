"""Broken: ``silu_and_mul`` reads its input as a contiguous ``[rows, 2d]`` tensor, ignoring its strides.

Imitates an activation kernel that indexes ``row * 2d + col`` rather than ``row * stride(0) + col *
stride(1)``: right for a fresh gate/up projection, wrong for a slice of a wider fused output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.interfaces.ops import silu_and_mul
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


def stride_blind_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    dense = x.as_strided(x.shape, torch.empty(x.shape, device="meta").stride(), x.storage_offset())
    return silu_and_mul(dense)


class SiluStridesPlatform(ReferencePlatform):
    name = "broken-silu-strides"

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        return {"silu_and_mul": stride_blind_silu_and_mul}


@hookimpl
def engine_register_platforms() -> list[type]:
    return [SiluStridesPlatform]

"""Broken: RMSNorm averages the squares over the width padded to a power of two.

Imitates a norm kernel that loads a row into a power-of-two block (``triton.next_power_of_2``), zero-fills
the padding, and then divides by the block width instead of the real one: right for hidden sizes 256,
512, 4096..., wrong for 576, 896 or 320 (SmolLM2, Qwen2-0.5B).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


def padded_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    width = x.shape[-1]
    block = 1 << (width - 1).bit_length()
    xf = x.float()
    mean_square = xf.pow(2).sum(-1, keepdim=True) / block  # should be / width
    return (xf * torch.rsqrt(mean_square + eps) * weight.float()).to(x.dtype)


class PaddedNormPlatform(ReferencePlatform):
    name = "broken-norm-width"

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        return {"rms_norm": padded_rms_norm}


@hookimpl
def engine_register_platforms() -> list[type]:
    return [PaddedNormPlatform]

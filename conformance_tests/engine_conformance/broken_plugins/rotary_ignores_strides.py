"""Broken: the rotary embedding reads q and k as if they were contiguous tensors.

Imitates a kernel that computes addresses from the shape alone (``token * heads * head_dim + ...``)
instead of the tensors' strides: right for separate contiguous q and k, wrong for the column ranges of
one fused qkv projection that models actually pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.interfaces.ops import rotary_embedding
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


def as_if_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The elements a stride-blind kernel reads for ``t``: its shape laid out densely from its start."""
    return t.as_strided(t.shape, torch.empty(t.shape, device="meta").stride(), t.storage_offset())


def stride_blind_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_embedding(positions, as_if_contiguous(query), as_if_contiguous(key), cos_sin_cache)


class RotaryStridesPlatform(ReferencePlatform):
    name = "broken-rotary-strides"

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        return {"rotary_embedding": stride_blind_rotary}


@hookimpl
def engine_register_platforms() -> list[type]:
    return [RotaryStridesPlatform]

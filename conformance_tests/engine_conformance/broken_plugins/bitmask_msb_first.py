"""Broken: the token bitmask is unpacked most significant bit first.

Imitates a structured-output kernel that reads bit ``31 - j`` of each word for token ``32 * w + j``
(xgrammar packs least significant bit first): all-allowed and all-disallowed words are right, any other
mask allows the wrong tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.interfaces.ops import apply_token_bitmask
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


def reverse_bits(words: torch.Tensor) -> torch.Tensor:
    """Each int32 word with its 32 bits in reverse order."""
    shifts = torch.arange(32, dtype=torch.int64, device=words.device)
    bits = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 1
    packed = (bits.flip(-1) << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def msb_first_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    apply_token_bitmask(logits, reverse_bits(bitmask), indices)


class MsbFirstBitmaskPlatform(ReferencePlatform):
    name = "broken-bitmask"

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        return {"apply_token_bitmask": msb_first_bitmask}


@hookimpl
def engine_register_platforms() -> list[type]:
    return [MsbFirstBitmaskPlatform]

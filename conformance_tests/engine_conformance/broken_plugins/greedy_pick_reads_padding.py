"""Broken: the greedy pick takes the argmax over the whole logits row, padding columns included.

Imitates a sampler that ignores ``vocab_size`` when the LM head's output is padded to a multiple of 64
or 128: right for models whose vocabulary fills the row, wrong (it picks a token that does not exist)
whenever a padding column holds the largest value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


def padded_greedy_pick(logits: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    token_ids = logits.argmax(dim=-1)
    raw = torch.log_softmax(logits[:, :vocab_size].float(), dim=-1)
    # the log-probability of a padding pick is read as the row's last real one
    return token_ids, raw.gather(1, token_ids.clamp(max=vocab_size - 1).unsqueeze(1)).squeeze(1)


class PaddedPickPlatform(ReferencePlatform):
    name = "broken-greedy-padding"

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        return {"greedy_pick": padded_greedy_pick}


@hookimpl
def engine_register_platforms() -> list[type]:
    return [PaddedPickPlatform]

"""Broken: the greedy pick returns the last of several tied maxima instead of the first.

Imitates a split argmax whose reduction keeps the later index on equal values (``>=`` where ``>`` was
meant): any row with a unique maximum is right, but a tie picks another token than torch's argmax (and
HF transformers) would, and greedy outputs diverge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


def last_tie_greedy_pick(logits: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    raw = torch.log_softmax(logits[:, :vocab_size].float(), dim=-1)
    # argmax of the reversed row: the last maximum
    token_ids = vocab_size - 1 - raw.flip(-1).argmax(dim=-1)
    return token_ids, raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)


class LastTiePlatform(ReferencePlatform):
    name = "broken-greedy-ties"

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        return {"greedy_pick": last_tie_greedy_pick}


@hookimpl
def engine_register_platforms() -> list[type]:
    return [LastTiePlatform]

"""A model's pooling defaults, read from the sentence-transformers files a checkpoint may carry
(``modules.json``, ``1_Pooling/config.json``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from engine.pooling.params import PoolingType

#: sentence-transformers' pooling flags -> the pooling type they stand for
_ST_MODES: tuple[tuple[str, PoolingType], ...] = (
    ("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"), ("pooling_mode_cls_token", "CLS"),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """A model's default pooling: LAST and normalized unless its files say otherwise."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True


def read_pooler_config(folder: str | None, default: PoolingType = "LAST") -> PoolerConfig:
    """The pooling a checkpoint declares.

    Args:
        folder: the model folder (None or a file: the defaults).
        default: the architecture's own pooling where the files declare none (``LAST`` for decoders,
            ``CLS`` for BERT-like encoders).

    Returns:
        The declared pooling type and whether a ``Normalize`` module follows it.

    Raises:
        ValueError: a pooling config the engine does not implement (e.g. max-pooling), named.
    """
    if folder is None or not os.path.isdir(folder):
        return PoolerConfig(default)
    modules_file = os.path.join(folder, "modules.json")
    if not os.path.exists(modules_file):
        return PoolerConfig(default)
    with open(modules_file) as f:
        modules = json.load(f)
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    if pooling is None:
        return PoolerConfig(default, normalize)
    with open(os.path.join(folder, pooling.get("path", "1_Pooling"), "config.json")) as f:
        flags = json.load(f)
    chosen = [kind for key, kind in _ST_MODES if flags.get(key)]
    others = [key for key, value in flags.items() if key.startswith("pooling_mode") and value and key not in dict(_ST_MODES)]
    if others or len(chosen) != 1:
        raise ValueError(f"sentence-transformers pooling {sorted(k for k, v in flags.items() if k.startswith('pooling_mode') and v)} is not supported (supported: one of lasttoken, mean_tokens, cls_token)")
    return PoolerConfig(chosen[0], normalize)

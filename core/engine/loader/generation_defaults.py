"""A checkpoint's sampling defaults: the ``temperature``, ``top_p``, ... of its ``generation_config.json``.

Model authors ship the settings their model was tuned for (Qwen3: ``temperature 0.6, top_p 0.95,
top_k 20``); with ``generation_config="auto"`` (the default) the engine uses them for every field a
request leaves unset, as the leading engine does with ``--generation-config auto``. ``do_sample`` is not
read: a default ``temperature`` is what makes a request greedy or not, whatever ``do_sample`` says.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

from pydantic import ValidationError

from engine.loader.hf_folder import GENERATION_CONFIG_FILE, read_json
from engine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

#: the ``generation_config.json`` fields a checkpoint may set a default for, in the order logs list them
GENERATION_DEFAULT_FIELDS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

#: ``auto``: the checkpoint's defaults; ``none``: the engine's own (``SamplingParams``' field defaults)
GenerationConfigMode = Literal["auto", "none"]


def read_generation_defaults(model_path: str) -> dict[str, float | int]:
    """The sampling defaults a HF model folder's ``generation_config.json`` sets.

    Args:
        model_path: a model folder (a GGUF file has no generation config: nothing is read for it).

    Returns:
        Field name -> value for each of :data:`GENERATION_DEFAULT_FIELDS` the file sets to a valid
        value; empty when there is no such file. A value ``SamplingParams`` would refuse (``top_p: 0``)
        is left out with a warning, so a checkpoint's odd file never turns every request away.

    Raises:
        ModelLoadError: the file exists but is not a JSON object.
    """
    path = os.path.join(model_path, GENERATION_CONFIG_FILE)
    if not os.path.isdir(model_path) or not os.path.isfile(path):
        return {}
    raw = read_json(path)
    defaults: dict[str, float | int] = {}
    for name in GENERATION_DEFAULT_FIELDS:
        value = raw.get(name)
        # a JSON ``true`` is an int to Python; no sampling field takes one
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            if value is not None:
                logger.warning("ignoring %s=%r in %s: not a number", name, value, path)
            continue
        if name == "top_k":
            if value != int(value):
                logger.warning("ignoring top_k=%r in %s: not an integer", value, path)
                continue
            value = int(value)
        try:
            SamplingParams(**{name: value})
        except ValidationError as exc:
            logger.warning("ignoring %s=%r in %s: %s", name, value, path, exc.errors()[0]["msg"])
            continue
        defaults[name] = value
    return defaults


def format_generation_defaults(defaults: dict[str, float | int]) -> str:
    """``temperature=0.6, top_p=0.9``: the defaults as one log line's tail, in field order."""
    return ", ".join(f"{name}={defaults[name]}" for name in GENERATION_DEFAULT_FIELDS if name in defaults)

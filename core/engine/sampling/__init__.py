"""Sampling settings and logits processing (detokenisation and stop conditions live in ``engine.output``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from engine.sampling.sampler import Sampler, SampleResult, SamplingRow, make_generator

__all__ = ["SampleResult", "Sampler", "SamplingParams", "SamplingRow", "make_generator"]

# Lazy, so that importing SamplingParams (config, CLI) does not import torch through the sampler.
_LAZY = {
    "SampleResult": "engine.sampling.sampler",
    "Sampler": "engine.sampling.sampler",
    "SamplingRow": "engine.sampling.sampler",
    "make_generator": "engine.sampling.sampler",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.sampling' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

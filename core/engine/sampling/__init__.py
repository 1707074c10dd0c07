"""Sampling settings, logits processing, detokenisation and stop conditions."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from engine.sampling.detokenizer import IncrementalDetokenizer
    from engine.sampling.sampler import (
        Sampler,
        SampleResult,
        SamplingRow,
        check_params_against_vocab,
        make_generator,
    )
    from engine.sampling.stop import StopChecker, StopDecision

__all__ = [
    "IncrementalDetokenizer",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "SamplingRow",
    "StopChecker",
    "StopDecision",
    "check_params_against_vocab",
    "make_generator",
]

# Lazy, so that importing SamplingParams (config, CLI) does not import torch through the sampler.
_LAZY = {
    "IncrementalDetokenizer": "engine.sampling.detokenizer",
    "SampleResult": "engine.sampling.sampler",
    "Sampler": "engine.sampling.sampler",
    "SamplingRow": "engine.sampling.sampler",
    "check_params_against_vocab": "engine.sampling.sampler",
    "make_generator": "engine.sampling.sampler",
    "StopChecker": "engine.sampling.stop",
    "StopDecision": "engine.sampling.stop",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.sampling' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

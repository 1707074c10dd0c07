"""Sampling settings, logits processing, detokenisation and stop conditions."""

from __future__ import annotations

from engine.sampling.params import SamplingParams

__all__ = ["SamplingParams"]

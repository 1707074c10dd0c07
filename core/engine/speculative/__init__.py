"""Speculative decoding: proposals checked by the target model in one forward pass, keeping its output
distribution exactly (``SpeculativeConfig``, the n-gram, suffix-decoding, draft-model and EAGLE proposers,
verification by rejection sampling)."""

from __future__ import annotations

from engine.speculative.config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "parse_speculative_config"]

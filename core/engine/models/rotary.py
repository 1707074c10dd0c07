"""Rotary position tables (plain, linear-scaled and Llama-3-scaled), built once per model."""

from __future__ import annotations

import math
from typing import Any

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1 keeps high frequencies, divides low ones by `factor`, and blends the band in between.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, blended, scaled)


def build_cos_sin_cache(
    head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None, device: Any = None
) -> torch.Tensor:
    """float32 ``[max_position, head_dim]``: ``cos`` of each frequency in the first half, ``sin`` in the second.

    Raises:
        ValueError: for a rope scaling type the engine does not implement.
    """
    # float32 throughout, as Hugging Face computes it: greedy outputs must match it token for token.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    positions = torch.arange(max_position, dtype=torch.float32)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            positions = positions / float(scaling["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind != "default":
            raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")
    freqs = torch.outer(positions, inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return cache.to(device) if device is not None else cache

"""Rotary frequencies for every RoPE type transformers defines, and the cos/sin tables built from them.

``default``, ``linear``, ``llama3`` and ``yarn`` give one table per model. ``dynamic`` (NTK) and
``longrope`` depend on the length of the sequence being run; :mod:`engine.models.layers.rope` picks
their rows per sequence with the ``seq_len`` argument of :func:`rope_inv_freq`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: the RoPE types :func:`rope_inv_freq` implements
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The RoPE type a HF ``rope_scaling`` / ``rope_parameters`` dict names (``default`` for none)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _base_exponents(dim: int) -> torch.Tensor:
    # float32 throughout, as Hugging Face computes it: greedy outputs must match it token for token
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate the low frequencies, keep the high ones, ramp linearly between the two
    # correction dimensions, and scale cos/sin by the attention factor.
    original = scaling.get("original_max_position_embeddings") or max_position
    factor = scaling.get("factor")
    if "original_max_position_embeddings" in scaling and factor is None:
        factor = max_position / original
    factor = float(factor)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all else yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention)


def _longrope_attention_factor(scaling: dict[str, Any], max_position: int) -> float:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = max_position / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return float(attention)


def dynamic_theta(theta: float, factor: float, dim: int, max_position: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """NTK-aware bases, one per sequence length (float32, as transformers computes them).

    Args:
        theta: the configured base.
        factor: the ``dynamic`` scaling factor.
        dim: the rotary width.
        max_position: the model's ``max_position_embeddings``.
        seq_lens: int64 sequence lengths; a length at or under ``max_position`` keeps ``theta``.

    Returns:
        float32 bases, the shape of ``seq_lens``.
    """
    lengths = torch.clamp_min(seq_lens, max_position)
    return theta * ((factor * lengths / max_position) - (factor - 1)) ** (dim / (dim - 2))


def rope_inv_freq(
    dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """The inverse frequencies of a rotary embedding and the factor its cos/sin are scaled by.

    Args:
        dim: the rotary width (the head size, or its rotated part).
        theta: the base.
        scaling: the HF RoPE parameters (``rope_type`` and its keys), or None.
        max_position: the model's ``max_position_embeddings``.
        seq_len: the length of the sequence being run, for ``dynamic`` and ``longrope`` (None: the
            short/original set).

    Returns:
        float32 inverse frequencies ``[dim // 2]`` and the attention factor.

    Raises:
        ValueError: a RoPE type transformers does not define.
    """
    kind = rope_type(scaling)
    inv_freq = 1.0 / (theta ** _base_exponents(dim))
    if kind == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "dynamic":
        base = dynamic_theta(theta, float(scaling["factor"]), dim, max_position, torch.tensor(seq_len or max_position))
        return 1.0 / (base ** _base_exponents(dim)), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, max_position)
    if kind == "longrope":
        is_long = seq_len is not None and seq_len > scaling["original_max_position_embeddings"]
        ext = torch.tensor(scaling["long_factor" if is_long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta ** _base_exponents(dim)), _longrope_attention_factor(scaling, max_position)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def cos_sin_table(inv_freq: torch.Tensor, positions: torch.Tensor, attention_factor: float = 1.0) -> torch.Tensor:
    """float32 ``[len(positions), 2 * len(inv_freq)]``: cos in the first half, sin in the second."""
    freqs = torch.outer(positions.float(), inv_freq)
    if attention_factor == 1.0:
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    theta: float,
    scaling: dict[str, Any] | None,
    device: Any = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """float32 ``[max_position, head_dim]``: ``cos`` of each frequency in the first half, ``sin`` in the second.

    Args:
        head_dim: the rotary width.
        max_position: rows of the table (and the model's ``max_position_embeddings``).
        theta: the base.
        scaling: HF RoPE parameters or None.
        device: where the table lives.
        seq_len: see :func:`rope_inv_freq` (``longrope``'s long set for a length past the original).

    Raises:
        ValueError: for a rope scaling type the engine does not implement.
    """
    inv_freq, attention = rope_inv_freq(head_dim, theta, scaling, max_position, seq_len)
    cache = cos_sin_table(inv_freq, torch.arange(max_position, dtype=torch.float32), attention)
    return cache.to(device) if device is not None else cache

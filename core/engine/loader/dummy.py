"""Random weights with a real checkpoint's names and shapes, for benchmarks and tests."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.loader.architectures import expected_weight_shapes, is_norm_weight
from engine.models.config import ModelConfig

DUMMY_WEIGHT_STD = 0.02


def dummy_weights(
    config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield random weights for every parameter of ``config``, deterministically for a given seed.

    Linear weights, biases and embeddings are normal with std 0.02 so activations stay in range through
    many layers; RMSNorm scales are 1 plus that noise.

    Args:
        config: the model config (names and shapes follow its architecture).
        seed: seed of the private random generator (global torch RNG state is untouched).
        dtype: dtype of the yielded tensors.
        device: where to draw them; drawing an 8B model on its accelerator takes seconds, on the host
            minutes (the values differ between devices, each deterministic by seed).

    Returns:
        An iterator of (HF name, tensor) pairs, in the same order as a HF checkpoint.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in expected_weight_shapes(config).items():
        values = torch.randn(shape, generator=generator, dtype=dtype, device=device) * DUMMY_WEIGHT_STD
        if is_norm_weight(name):
            values += 1.0
        yield name, values

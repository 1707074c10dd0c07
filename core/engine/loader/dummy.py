"""Random weights with a real checkpoint's names and shapes, for benchmarks and tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from engine.loader.architectures import registry_or_core
from engine.models.config import ModelConfig

if TYPE_CHECKING:
    from engine.models.registry import ModelRegistry

DUMMY_WEIGHT_STD = 0.02


def dummy_weights(
    config: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    registry: ModelRegistry | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield random weights for every parameter of ``config``, deterministically for a given seed.

    Weights, biases and embeddings are normal with std 0.02 so activations stay in range through
    many layers; norm scales (the model class's ``is_norm_scale``) are 1 plus that noise.

    Args:
        config: the model config (names and shapes follow its architecture's ``weight_shapes``).
        seed: seed of the private random generator (global torch RNG state is untouched).
        dtype: dtype of the yielded tensors.
        device: where to draw them; drawing an 8B model on its accelerator takes seconds, on the host
            minutes (the values differ between devices, each deterministic by seed).
        registry: the model registry that resolves ``config.architecture`` (default: the core's).

    Returns:
        An iterator of (HF name, tensor) pairs, in the same order as a HF checkpoint.

    Raises:
        ModelLoadError: the architecture is not registered.
    """
    model_class = registry_or_core(registry).resolve(config.architecture, "the model config")
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in model_class.weight_shapes(config).items():
        values = torch.randn(shape, generator=generator, dtype=dtype, device=device) * DUMMY_WEIGHT_STD
        if model_class.is_norm_scale(name):
            values += 1.0
        yield name, values

"""Which architectures the loader accepts, and the tensors a checkpoint of each must hold.

Both questions are answered by the model registry (:mod:`engine.models.registry`): the names are its
keys, the tensors come from the resolved class's ``weight_shapes``. Without a registry, the core's
architectures only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from engine.loader.errors import ModelLoadError
from engine.models.config import ModelConfig

if TYPE_CHECKING:
    from engine.models.base import CausalLM
    from engine.models.registry import ModelRegistry


def registry_or_core(registry: ModelRegistry | None) -> ModelRegistry:
    """``registry``, or the core-only registry when it is None."""
    if registry is not None:
        return registry
    # imported here: the registry imports the models, which import this package
    from engine.models.registry import ModelRegistry

    return ModelRegistry.core()


def supported_architectures(registry: ModelRegistry | None = None) -> list[str]:
    """Return the HF ``architectures`` names the loader can load, e.g. ``"LlamaForCausalLM"``.

    Args:
        registry: the model registry (default: the core's architectures only).
    """
    return registry_or_core(registry).supported()


def expected_weight_shapes(
    config: ModelConfig, registry: ModelRegistry | None = None
) -> dict[str, tuple[int, ...]]:
    """Return every tensor a checkpoint of ``config`` must provide, by HF name, in load order.

    Args:
        config: the model config.
        registry: the model registry that resolves ``config.architecture`` (default: the core's).

    Returns:
        The resolved class's :meth:`~engine.models.base.CausalLM.weight_shapes`.

    Raises:
        ModelLoadError: the architecture is not registered.
    """
    return registry_or_core(registry).resolve(config.architecture, "the model config").weight_shapes(config)


def check_weight_stream(
    weights: Iterator[tuple[str, Any]], config: ModelConfig, source: str, model_class: type[CausalLM]
) -> Iterator[tuple[str, Any]]:
    """Pass ``weights`` through, failing on a tensor the model does not have, a wrong shape, a repeat,
    or (after the last one) a missing tensor, so a bad checkpoint never loads half-way silently.

    Args:
        weights: (HF name, tensor) pairs from a checkpoint.
        config: the model config the checkpoint must match.
        source: the checkpoint path, for messages.
        model_class: the resolved model class, whose ``weight_shapes(config)`` the stream must match.

    Returns:
        An iterator over the same pairs.

    Raises:
        ModelLoadError: the checkpoint does not match ``config``.
    """
    expected = model_class.weight_shapes(config)
    seen: set[str] = set()
    for name, tensor in weights:
        shape = expected.get(name)
        if shape is None:
            raise ModelLoadError(f"unexpected tensor '{name}' in {source} for {config.architecture}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"tensor '{name}' in {source} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        if name in seen:
            raise ModelLoadError(f"tensor '{name}' appears twice in {source}")
        seen.add(name)
        yield name, tensor
    missing = [name for name in expected if name not in seen]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelLoadError(f"checkpoint {source} lacks tensor '{missing[0]}'{more}")

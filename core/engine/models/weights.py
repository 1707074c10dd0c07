"""Taking named tensors out of a loaded checkpoint with their shapes checked (shared by model definitions)."""

from __future__ import annotations

from typing import Any


def take_tensor(tensors: dict[str, Any], name: str, shape: tuple[int, ...]) -> Any:
    """Remove and return ``tensors[name]``, checking it exists with ``shape``.

    Works for any array type with a ``shape`` (torch tensors, numpy arrays), so a platform's own model
    runner loads weights with the same checks as the core's models.

    Raises:
        ValueError: the tensor is missing or has another shape.
    """
    if name not in tensors:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    tensor = tensors.pop(name)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor

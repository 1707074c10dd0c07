"""Float64 references of the collectives: what rank ``rank`` should hold, from every rank's input.

``parts[i]`` is rank ``i``'s input (any device and dtype); each function returns a float64 CPU tensor,
the value a :class:`~engine.interfaces.communicator.Communicator` of ``len(parts)`` ranks must produce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["reference_all_gather", "reference_all_reduce", "reference_all_to_all", "reference_reduce_scatter"]


def _f64(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if not parts:
        raise ValueError("a collective needs at least one rank's input")
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        raise ValueError(f"every rank's input must have one shape, got {sorted(shapes)}")
    return [p.detach().to("cpu", torch.float64) for p in parts]


def reference_all_reduce(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of every rank's input (every rank holds the same).

    Raises:
        ValueError: no inputs, or inputs of different shapes.
    """
    return torch.stack(_f64(parts)).sum(dim=0)


def reference_all_gather(parts: Sequence[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """Every rank's input concatenated along ``dim`` in rank order (every rank holds the same).

    Raises:
        ValueError: no inputs, or inputs of different shapes.
    """
    return torch.cat(_f64(parts), dim=dim)


def reference_reduce_scatter(parts: Sequence[torch.Tensor], rank: int, dim: int = 0) -> torch.Tensor:
    """Slice ``rank`` along ``dim`` of the sum of every rank's input.

    Raises:
        ValueError: no inputs, different shapes, or ``dim`` not divisible by the number of ranks.
    """
    total = reference_all_reduce(parts)
    world = len(parts)
    if total.shape[dim] % world:
        raise ValueError(f"dim {dim} has {total.shape[dim]} rows, not divisible by {world} ranks")
    return total.chunk(world, dim=dim)[rank]


def reference_all_to_all(parts: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """Slice ``rank`` (along dim 0) of every rank's input, concatenated in rank order.

    Raises:
        ValueError: no inputs, different shapes, or dim 0 not divisible by the number of ranks.
    """
    inputs = _f64(parts)
    world = len(inputs)
    if inputs[0].shape[0] % world:
        raise ValueError(f"dim 0 has {inputs[0].shape[0]} rows, not divisible by {world} ranks")
    return torch.cat([p.chunk(world, dim=0)[rank] for p in inputs], dim=0)

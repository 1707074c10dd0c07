"""The collectives contract: how the ranks of a parallel engine exchange tensors.

One communicator per process group (the tensor-parallel ranks, the pipeline stages, the expert ranks).
Every rank calls each collective with tensors of the same shape and dtype, in the same order; a
communicator with ``world_size == 1`` returns its input (no library call). A plugin builds them through
:meth:`engine.interfaces.platform.Platform.make_communicator` and claims ``Capabilities.distributed``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Communicator(ABC):
    """Collectives among ``world_size`` ranks; this process is rank ``rank``.

    Attributes:
        world_size: ranks in the group.
        rank: this process's rank, ``0 <= rank < world_size``.
    """

    world_size: int
    rank: int

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over every rank, in place.

        Args:
            tensor: this rank's contribution (contiguous).

        Returns:
            ``tensor``, now holding the sum.
        """

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order.

        Returns:
            A new tensor whose ``dim`` is ``world_size`` times as long.
        """

    @abstractmethod
    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum ``tensor`` over every rank and keep this rank's slice along ``dim``.

        Args:
            tensor: this rank's contribution; ``dim`` divisible by ``world_size``.

        Returns:
            Slice ``rank`` (of ``world_size`` equal slices along ``dim``) of the sum.

        Raises:
            ValueError: ``dim`` is not divisible by ``world_size``.
        """

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` copied into every rank's ``tensor``, in place; returns it."""

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst`` (pipeline stages); blocks until it may be reused."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive from rank ``src`` into ``tensor`` (its shape and dtype as sent); returns it."""

    @abstractmethod
    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Exchange equal slices (experts): slice ``j`` of dim 0 goes to rank ``j``; returns the slices
        received, slice ``i`` from rank ``i``.

        Raises:
            ValueError: dim 0 is not divisible by ``world_size``.
        """

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank reaches it."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group and free its resources; safe to call twice."""

    def split(self, groups: list[list[int]]) -> Communicator:
        """This rank's communicator in a partition of the group (tensor- within pipeline-parallel ranks).

        Every rank of this group calls it, with the same ``groups`` in the same order. In the returned
        communicator a group's ranks are numbered in ascending order of their ranks here, whatever the
        order of its list (as ``torch.distributed.new_group`` and NCCL's split do); it is closed with
        this one (its own :meth:`close` does nothing).

        Args:
            groups: lists of this group's ranks; together they hold every rank once.

        Raises:
            ValueError: ``groups`` is not a partition of the ranks.
            NotImplementedError: the communicator does not split (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} does not split into sub-groups")

"""The one ``torch.distributed`` implementation of the collectives contract (:class:`Communicator`).

:class:`TorchDistributedCommunicator` is generic over the backend name: ``"gloo"`` on CPU tensors here,
``"nccl"`` (NCCL, or RCCL under ROCm) in :mod:`engine_plugin_sdk.gpu.communicator`, ``"hccl"`` in the
Ascend plugin. A subclass sets ``backend`` and ``library`` and overrides the hooks its device needs
(``check_torch_build``, ``check_backend_available``, ``select_device``).
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch

from engine.interfaces.communicator import Communicator

__all__ = ["TorchDistributedCommunicator"]

_Self = TypeVar("_Self", bound="TorchDistributedCommunicator")

# words in a backend's refusal of an op it does not implement: only such an error switches a collective to
# its fallback (every rank runs the same build, so every rank refuses the same call before sending anything)
_UNSUPPORTED_WORDS = ("not supported", "does not support", "unsupported", "not implemented")


def _unsupported(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, NotImplementedError) or any(word in text for word in _UNSUPPORTED_WORDS)


class TorchDistributedCommunicator(Communicator):
    """Every collective of the contract over one ``torch.distributed`` backend, one process per rank.

    The process group is the default (world) group: created here with
    ``init_process_group(backend, init_method=..., world_size=..., rank=...)`` unless this process already
    has one of the same size and rank, which is then used and left to its owner by :meth:`close`.
    A group of one creates no process group at all: every collective returns its input.

    Args:
        world_size: ranks in the group.
        rank: this process's rank.
        init_method: the rendezvous every rank passes, e.g. ``"tcp://127.0.0.1:29500"``.
        local_rank: this process's index among the ranks of its host (which device it drives).

    Raises:
        ValueError: ``rank`` is not in ``[0, world_size)``.
        RuntimeError: the torch build lacks the backend, the device is missing, or an existing process
            group has another size or rank.
    """

    #: the ``torch.distributed`` backend name
    backend: str = "gloo"
    #: the collective library behind the backend, for messages
    library: str = "gloo"

    def __init__(self, world_size: int, rank: int, init_method: str, local_rank: int = 0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.check_torch_build()
        self.world_size = world_size
        self.rank = rank
        self.local_rank = local_rank
        self.device = self.select_device(local_rank)
        self._owns_group = False
        self._closed = False
        #: the torch process group of a communicator made by :meth:`split` (None: the world group), and
        #: the world ranks of its members in its own rank order
        self._group: Any = None
        self._world_ranks: list[int] = list(range(world_size))
        # flipped off the first time the backend refuses the native op
        self._native_reduce_scatter = True
        self._native_all_to_all = True
        if world_size == 1:
            return
        import torch.distributed as dist

        if not dist.is_available():
            raise RuntimeError(f"this torch build ({torch.__version__}) has no torch.distributed")
        self.check_backend_available()
        if dist.is_initialized():
            if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
                raise RuntimeError(
                    f"this process already has a process group of {dist.get_world_size()} ranks as rank "
                    f"{dist.get_rank()}, not {world_size} ranks as rank {rank}"
                )
        else:
            dist.init_process_group(self.backend, init_method=init_method, world_size=world_size, rank=rank)
            self._owns_group = True

    # --- hooks for a backend's subclass ----------------------------------------------------------------

    @classmethod
    def check_torch_build(cls) -> None:
        """Raise RuntimeError when this torch build cannot drive the backend's devices (nothing here)."""

    def check_backend_available(self) -> None:
        """Raise RuntimeError when ``torch.distributed`` does not know :attr:`backend` in this build."""
        import torch.distributed as dist

        checks = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available}
        check = checks.get(self.backend)
        if check is not None and not check():
            raise RuntimeError(f"this torch build ({torch.__version__}) has no {self.library} backend")

    def select_device(self, local_rank: int) -> torch.device:
        """The device this rank's tensors live on (the host CPU here); a GPU subclass makes it current."""
        return torch.device("cpu")

    # --- the contract -----------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over every rank, in place; returns it."""
        if self.world_size > 1:
            self._in_place(tensor, lambda t: self._dist.all_reduce(t, group=self._group))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order (one rank: the input itself)."""
        if self.world_size == 1:
            return tensor
        parts = [
            torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(self.world_size)
        ]
        self._dist.all_gather(parts, tensor.contiguous(), group=self._group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Slice ``rank`` along ``dim`` of the sum of every rank's ``tensor`` (``tensor`` is left as it was).

        Raises:
            ValueError: ``tensor.shape[dim]`` is not divisible by ``world_size``.
        """
        size = tensor.shape[dim]
        if size % self.world_size:
            raise ValueError(
                f"reduce_scatter: dim {dim} has {size} rows, not divisible by {self.world_size} ranks"
            )
        if self.world_size == 1:
            return tensor
        # the native op splits dim 0 of a contiguous tensor
        moved = tensor.movedim(dim, 0).contiguous()
        out = torch.empty(
            (size // self.world_size, *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device
        )
        if self._native_reduce_scatter:
            native = getattr(self._dist, "reduce_scatter_single", None) or self._dist.reduce_scatter_tensor
            try:
                native(out, moved, group=self._group)
                return out.movedim(0, dim)
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                if not _unsupported(exc):
                    raise
                self._native_reduce_scatter = False
        total = moved.clone()
        self._dist.all_reduce(total, group=self._group)
        return total.chunk(self.world_size, dim=0)[self.rank].movedim(0, dim).contiguous()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` copied into every rank's ``tensor``, in place; returns it.

        Raises:
            ValueError: ``src`` is not a rank of the group.
        """
        self._check_peer(src, "src", allow_self=True)
        if self.world_size > 1:
            self._in_place(tensor, lambda t: self._dist.broadcast(t, self._world_ranks[src], group=self._group))
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst``; returns once ``tensor`` may be reused.

        Raises:
            ValueError: ``dst`` is this rank or not a rank of the group.
        """
        self._check_peer(dst, "dst")
        self._dist.send(tensor.contiguous(), self._world_ranks[dst], group=self._group)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive from rank ``src`` into ``tensor``; returns it.

        Raises:
            ValueError: ``src`` is this rank or not a rank of the group.
        """
        self._check_peer(src, "src")
        self._in_place(tensor, lambda t: self._dist.recv(t, self._world_ranks[src], group=self._group))
        return tensor

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Slice ``j`` of dim 0 goes to rank ``j``; returns the slices received, slice ``i`` from rank ``i``.

        Raises:
            ValueError: dim 0 is not divisible by ``world_size``.
        """
        if tensor.dim() == 0 or tensor.shape[0] % self.world_size:
            rows = tensor.shape[0] if tensor.dim() else 0
            raise ValueError(f"all_to_all: dim 0 has {rows} rows, not divisible by {self.world_size} ranks")
        if self.world_size == 1:
            return tensor
        source = tensor.contiguous()
        if self._native_all_to_all:
            out = torch.empty_like(source)
            try:
                self._dist.all_to_all_single(out, source, group=self._group)
                return out
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                if not _unsupported(exc):
                    raise
                self._native_all_to_all = False
        # every rank's whole tensor, then this rank's slice of each: world_size times the traffic
        gathered = [torch.empty_like(source) for _ in range(self.world_size)]
        self._dist.all_gather(gathered, source, group=self._group)
        return torch.cat([part.chunk(self.world_size, dim=0)[self.rank] for part in gathered], dim=0)

    def barrier(self) -> None:
        """Wait until every rank reaches it."""
        if self.world_size > 1:
            self._dist.barrier(group=self._group)

    def close(self) -> None:
        """Destroy the process group this communicator created; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def split(self: _Self, groups: list[list[int]]) -> _Self:
        """This rank's communicator in a partition of the group (``torch.distributed.new_group`` for each
        group, created by every rank in the same order, as torch requires).

        Raises:
            ValueError: ``groups`` is not a partition of ``range(world_size)``.
        """
        members = sorted(r for group in groups for r in group)
        if members != list(range(self.world_size)) or any(not group for group in groups):
            raise ValueError(f"groups {groups} do not partition the {self.world_size} ranks of this group")
        ordered = [sorted(group) for group in groups]
        (own,) = [group for group in ordered if self.rank in group]
        child = copy.copy(self)
        child.world_size, child.rank, child._owns_group = len(own), own.index(self.rank), False
        child._world_ranks = [self._world_ranks[r] for r in own]
        if self.world_size > 1:
            handles = [self._dist.new_group([self._world_ranks[r] for r in group]) for group in ordered]
            child._group = handles[ordered.index(own)]
        return child

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- helpers ----------------------------------------------------------------------------------------

    @property
    def _dist(self) -> Any:
        if self._closed:
            raise RuntimeError(f"this {self.library} communicator is closed")
        import torch.distributed as dist

        return dist

    def _check_peer(self, peer: int, what: str, allow_self: bool = False) -> None:
        if not 0 <= peer < self.world_size or (peer == self.rank and not allow_self):
            raise ValueError(
                f"{what}={peer} is not another rank of this group of {self.world_size} (rank {self.rank})"
            )

    @staticmethod
    def _in_place(tensor: torch.Tensor, op: Any) -> None:
        # the libraries work on contiguous memory: run on a copy and write it back when a view is strided
        if tensor.is_contiguous():
            op(tensor)
            return
        work = tensor.contiguous()
        op(work)
        tensor.copy_(work)

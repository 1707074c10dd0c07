"""A ``torch.distributed`` communicator for tensor parallelism, one process per GPU.

ROCm builds of torch register RCCL under the backend name ``"nccl"``, so the process group is created
the same way on NVIDIA and AMD; the vendor subclasses add only their build check and library name.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import torch

_Communicator = TypeVar("_Communicator", bound="TorchDistCommunicator")


class TorchDistCommunicator:
    """All-reduce and all-gather over the ``"nccl"`` backend (NCCL, or RCCL under ROCm).

    Args:
        world_size: processes (one GPU each).
        rank: this process's rank; it uses GPU ``rank``.
        init_method: rendezvous address, e.g. ``"tcp://127.0.0.1:29500"``.

    Raises:
        RuntimeError: when the torch build cannot drive this vendor's GPUs, has no collective backend,
            or the GPU is missing.
    """

    #: the collective library behind the backend, for messages
    library: ClassVar[str] = "NCCL"

    def __init__(self, world_size: int, rank: int, init_method: str) -> None:
        import torch.distributed as dist

        self.check_torch_build()
        if not dist.is_available() or not dist.is_nccl_available():
            raise RuntimeError(f"this torch build has no {self.library} backend")
        if rank >= torch.cuda.device_count():
            raise RuntimeError(f"rank {rank} has no GPU (only {torch.cuda.device_count()} visible)")
        self.world_size = world_size
        self.rank = rank
        self.device = torch.device("cuda", rank)
        torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method=init_method, world_size=world_size, rank=rank)
        self._dist = dist

    @classmethod
    def check_torch_build(cls) -> None:
        """Raise RuntimeError when this torch build cannot drive the vendor's GPUs (nothing to check here)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place; returns it."""
        if self.world_size > 1:
            self._dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world_size > 1:
            self._dist.barrier()

    def close(self) -> None:
        """Tear the process group down."""
        if self._dist.is_initialized():
            self._dist.destroy_process_group()

    def __enter__(self: _Communicator) -> _Communicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""Tensor-parallel collectives over HCCL (``torch.distributed`` with torch_npu's ``hccl`` backend)."""

from __future__ import annotations

import torch


class AscendCommunicator:
    """All-reduce and all-gather across the ranks of one tensor-parallel group.

    Args:
        backend: the ``torch.distributed`` backend (``"hccl"`` on NPUs; the test substitute uses ``"gloo"``).
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def init(self, rank: int, world_size: int, init_method: str) -> None:
        """Join the process group (once per process).

        Raises:
            ValueError: for a rank outside ``[0, world_size)``.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(self.backend, init_method=init_method, rank=rank, world_size=world_size)

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_initialized() else 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place; returns it."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` (rank order)."""
        world = self.world_size
        if world == 1:
            return tensor
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    def shutdown(self) -> None:
        """Leave the process group if this process joined one."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

"""The ``torch.distributed`` communicator on GPUs: one process per GPU, backend ``"nccl"``.

ROCm builds of torch register RCCL under the backend name ``"nccl"``, so the process group is created
the same way on NVIDIA and AMD; the vendor subclasses add only their build check and library name. The
collectives themselves are :class:`~engine_plugin_sdk.communicator.TorchDistributedCommunicator`'s.
"""

from __future__ import annotations

import torch

from engine_plugin_sdk.communicator import TorchDistributedCommunicator

__all__ = ["TorchDistCommunicator"]


class TorchDistCommunicator(TorchDistributedCommunicator):
    """Every collective of the contract over the ``"nccl"`` backend (NCCL, or RCCL under ROCm).

    Args:
        world_size: processes (one GPU each).
        rank: this process's rank.
        init_method: rendezvous address, e.g. ``"tcp://127.0.0.1:29500"``.
        local_rank: the GPU this process drives (``cuda:local_rank``).

    Raises:
        ValueError: ``rank`` is not in ``[0, world_size)``.
        RuntimeError: when the torch build cannot drive this vendor's GPUs, has no collective backend,
            or the GPU is missing.
    """

    backend = "nccl"
    library = "NCCL"

    def check_backend_available(self) -> None:
        """Raise RuntimeError when the torch build has no ``"nccl"`` backend."""
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise RuntimeError(f"this torch build ({torch.__version__}) has no {self.library} backend")

    def select_device(self, local_rank: int) -> torch.device:
        """``cuda:local_rank``, made the current device (NCCL binds each rank's communicator to it).

        Raises:
            RuntimeError: the GPU is not visible.
        """
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not 0 <= local_rank < count:
            raise RuntimeError(f"local rank {local_rank} has no GPU (only {count} visible)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device

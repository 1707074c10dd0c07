"""NCCL communicator for tensor, pipeline and expert parallelism (one process per GPU)."""

from __future__ import annotations

from engine_plugin_sdk.gpu.communicator import TorchDistCommunicator

__all__ = ["NcclCommunicator"]


class NcclCommunicator(TorchDistCommunicator):
    """Every collective of the contract over NCCL through ``torch.distributed``, one process per GPU.

    Takes ``(world_size, rank, init_method, local_rank=0)`` like :class:`TorchDistCommunicator` and drives
    ``cuda:local_rank``; raises RuntimeError when torch has no NCCL backend or the GPU is missing.
    """

    library = "NCCL"

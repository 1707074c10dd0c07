"""NCCL communicator for tensor parallelism (used once the core shards models; one process per GPU)."""

from __future__ import annotations

from engine_plugin_sdk.gpu.communicator import TorchDistCommunicator

__all__ = ["NcclCommunicator"]


class NcclCommunicator(TorchDistCommunicator):
    """All-reduce and all-gather over NCCL through ``torch.distributed``, one process per GPU.

    Takes ``(world_size, rank, init_method)`` like :class:`TorchDistCommunicator`; raises RuntimeError
    when torch has no NCCL backend or the GPU is missing.
    """

    library = "NCCL"

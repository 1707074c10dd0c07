"""RCCL communicator for tensor, pipeline and expert parallelism (one process per AMD GPU).

ROCm builds of torch register RCCL under the backend name ``"nccl"``, so the process group is created
exactly as on NVIDIA (:mod:`engine_plugin_sdk.gpu.communicator`); what differs is the check
that this really is a ROCm build.
"""

from __future__ import annotations

import torch

from engine_plugin_sdk.gpu.communicator import TorchDistCommunicator

__all__ = ["RcclCommunicator"]


class RcclCommunicator(TorchDistCommunicator):
    """Every collective of the contract over RCCL through ``torch.distributed``, one process per GPU.

    Takes ``(world_size, rank, init_method, local_rank=0)`` like :class:`TorchDistCommunicator`; raises
    RuntimeError on a torch build without ROCm or RCCL, or when the GPU is missing.
    """

    library = "RCCL"

    @classmethod
    def check_torch_build(cls) -> None:
        """Raise RuntimeError on a CUDA or CPU build: its ``"nccl"`` backend cannot drive AMD GPUs."""
        if getattr(torch.version, "hip", None) is None:
            raise RuntimeError(f"RCCL needs a ROCm build of torch; this one ({torch.__version__}) has no HIP")

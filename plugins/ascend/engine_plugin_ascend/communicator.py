"""Collectives over HCCL (``torch.distributed`` with torch_npu's ``hccl`` backend), one process per NPU.

**Unverified here** on an NPU: the collectives are the SDK's
:class:`~engine_plugin_sdk.TorchDistributedCommunicator`; what is Ascend's is the backend and device,
both taken from the kernel module (:mod:`engine_plugin_ascend.npu_kernels`: ``hccl`` on ``npu:local_rank``;
the CPU substitute :mod:`engine_plugin_ascend.reference_kernels`: ``gloo`` on the host, which the tests run).
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine_plugin_sdk import TorchDistributedCommunicator

__all__ = ["AscendCommunicator"]


class AscendCommunicator(TorchDistributedCommunicator):
    """Every collective of the contract over the kernel module's backend (``hccl`` on NPUs).

    Args:
        world_size: ranks in the group.
        rank: this process's rank.
        init_method: the rendezvous every rank passes, e.g. ``"tcp://127.0.0.1:29500"``.
        local_rank: the NPU this process drives.
        kernels: the platform's kernel module (its ``COMMUNICATOR_BACKEND`` and ``torch_device``).

    Raises:
        ValueError: for a rank outside ``[0, world_size)``.
        RuntimeError: torch_npu cannot be imported (``hccl``), or the process group cannot be formed.
    """

    def __init__(
        self, world_size: int, rank: int, init_method: str, local_rank: int = 0, *, kernels: ModuleType
    ) -> None:
        # per instance: the same class drives hccl on an NPU and gloo on the CPU substitute
        self.backend = kernels.COMMUNICATOR_BACKEND
        self.library = "HCCL" if self.backend == "hccl" else self.backend
        self._kernels = kernels
        super().__init__(world_size, rank, init_method, local_rank)

    def check_backend_available(self) -> None:
        """Raise RuntimeError when the ``hccl`` backend is not registered (torch_npu registers it)."""
        if self.backend != "hccl":
            super().check_backend_available()
            return
        try:
            self._kernels.torch_device(self.local_rank)  # imports torch_npu, which registers hccl
        except ImportError as exc:
            raise RuntimeError(f"HCCL needs torch_npu, which cannot be imported: {exc}") from exc

    def select_device(self, local_rank: int) -> torch.device:
        """The kernel module's device for ``local_rank``, made current on an NPU.

        Raises:
            RuntimeError: torch_npu cannot be imported.
        """
        try:
            device = self._kernels.torch_device(local_rank)
        except ImportError as exc:
            raise RuntimeError(f"HCCL needs torch_npu, which cannot be imported: {exc}") from exc
        if device.type != "cpu":
            # HCCL binds each rank's communicator to the current NPU; torch_npu adds ``torch.npu``
            getattr(torch, device.type).set_device(device)
        return device

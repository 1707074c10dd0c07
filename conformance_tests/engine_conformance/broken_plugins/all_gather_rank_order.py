"""Broken: all_gather concatenates the ranks' tensors in reverse rank order."""

from __future__ import annotations

import dataclasses

import torch

from engine.interfaces.communicator import Communicator
from engine.interfaces.platform import Capabilities
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.communicator import TorchDistributedCommunicator
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class ReversedGatherCommunicator(TorchDistributedCommunicator):
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts[::-1], dim=dim)


class ReversedGatherPlatform(ReferencePlatform):
    name = "broken-all-gather"

    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities(), distributed=True)

    def make_communicator(
        self, world_size: int, rank: int, init_method: str, local_rank: int = 0
    ) -> Communicator:
        return ReversedGatherCommunicator(world_size, rank, init_method, local_rank)


@hookimpl
def engine_register_platforms() -> list[type]:
    return [ReversedGatherPlatform]

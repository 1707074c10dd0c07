"""Broken: attention reads a sequence's blocks as 0, 1, 2, ... instead of through its block table."""

from __future__ import annotations

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class ContiguousBlocksAttention(ReferenceAttentionBackend):
    def sequence_block_ids(self, metadata: AttentionMetadata, seq: int, num_blocks: int) -> torch.Tensor:
        return torch.arange(num_blocks, device=metadata.block_tables.device)


class IgnoresBlockTablePlatform(ReferencePlatform):
    name = "broken-block-table"

    def make_attention_backend(self) -> AttentionBackend:
        return ContiguousBlocksAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [IgnoresBlockTablePlatform]

"""Broken: a sliding window whose length is a multiple of the block size lets one key too many in.

Imitates a kernel that finds the window's first block with ``(pos - window) // block_size`` and masks
from there with ``>=`` instead of ``>``: when the window edge falls exactly on a block boundary the
key just outside it is attended. Windows that end mid-block are right.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class BlockMultipleWindowAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        window = metadata.sliding_window
        if window is not None and window % metadata.block_size == 0:
            metadata = dataclasses.replace(metadata, sliding_window=window + 1)
        return super().forward(query, key, value, kv_cache, metadata)


class WindowBlockMultiplePlatform(ReferencePlatform):
    name = "broken-window-edge"

    def make_attention_backend(self) -> AttentionBackend:
        return BlockMultipleWindowAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [WindowBlockMultiplePlatform]

"""Broken: copy-on-write block copies of 4 or more pairs drop the pairs past the last full group of 4.

Imitates a batched copy kernel that, above its small-batch path, launches ``len(pairs) // 4`` programs of
4 pairs each: 1 to 3 pairs (the usual fork of one partly filled block) and exact multiples of 4 are
right; 5 pairs lose the fifth.
"""

from __future__ import annotations

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform
from engine_plugin_sdk.torch_block_cache import TorchBlockCache

ENGINE_PLUGIN_API = ">=2.0,<3"

GROUP = 4


class GroupedCopyCache(TorchBlockCache):
    def copy_blocks(self, src_to_dst: list[tuple[int, int]]) -> None:
        if len(src_to_dst) >= GROUP:
            src_to_dst = src_to_dst[: len(src_to_dst) // GROUP * GROUP]
        super().copy_blocks(src_to_dst)


class CopyGroupsPlatform(ReferencePlatform):
    name = "broken-block-copy"

    def make_block_cache(self, spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend) -> BlockCache:
        return GroupedCopyCache(spec, num_blocks, attention, device=self.torch_device_type)


@hookimpl
def engine_register_platforms() -> list[type]:
    return [CopyGroupsPlatform]

"""Broken: swaps sort the source ids and the destination ids separately, assuming pairs come sorted.

Imitates a swap kernel that builds its gather and scatter index lists independently (or a host loop
that sorts "for locality" without keeping the pairs together): one pair, or pairs that are sorted in
both ids, move right; the scheduler's unsorted pairs land in each other's blocks.
"""

from __future__ import annotations

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform
from engine_plugin_sdk.torch_block_cache import TorchBlockCache

ENGINE_PLUGIN_API = ">=2.0,<3"


def sorted_separately(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return list(zip(sorted(s for s, _ in pairs), sorted(d for _, d in pairs), strict=True))


class SortedSwapCache(TorchBlockCache):
    def swap_out(self, device_to_host: list[tuple[int, int]]) -> None:
        super().swap_out(sorted_separately(device_to_host))

    def swap_in(self, host_to_device: list[tuple[int, int]]) -> None:
        super().swap_in(sorted_separately(host_to_device))


class SortedSwapPlatform(ReferencePlatform):
    name = "broken-swap"

    def make_block_cache(self, spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend) -> BlockCache:
        return SortedSwapCache(spec, num_blocks, attention, device=self.torch_device_type)


@hookimpl
def engine_register_platforms() -> list[type]:
    return [SortedSwapPlatform]

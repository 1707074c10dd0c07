"""The KV block pool in host memory, with a second pool standing in for "host" swap space."""

from __future__ import annotations

import torch

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine_plugin_cpu.platform import torch_dtype
from engine_plugin_sdk.block_ids import block_id_pairs


class CpuBlockCache(BlockCache):
    """All layers' KV blocks in one tensor ``[num_layers, *kv_cache_shape]``.

    One tensor (with per-layer views in :attr:`kv_caches`) lets a block copy or swap touch every layer
    in a single indexed copy instead of one per layer.

    Args:
        spec: cache geometry.
        num_blocks: blocks in the working pool.
        attention: the backend whose ``kv_cache_shape`` fixes each layer's layout; the block axis must be
            axis 1 (``[2, num_blocks, ...]``), as for :class:`CpuAttentionBackend`.
        num_host_blocks: blocks in the swap pool; default a quarter of ``num_blocks`` (at least 1).

    Raises:
        ValueError: for a non-positive block count or a layout without the block axis at 1.
    """

    supports_swap = True

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        attention: AttentionBackend,
        num_host_blocks: int | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if num_host_blocks is None:
            num_host_blocks = max(1, num_blocks // 4)
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be non-negative, got {num_host_blocks}")
        layer_shape = tuple(
            attention.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        )
        if len(layer_shape) < 2 or layer_shape[1] != num_blocks:
            raise ValueError(
                f"CpuBlockCache needs the block axis at position 1 of the layer layout, got {layer_shape}"
            )
        dtype = torch_dtype(spec.dtype)
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        # zeros rather than empty: stale NaN bit patterns in never-written slots would poison masked matmuls
        self.pool = torch.zeros((spec.num_layers, *layer_shape), dtype=dtype)
        host_shape = (spec.num_layers, layer_shape[0], num_host_blocks, *layer_shape[2:])
        self.host_pool = torch.zeros(host_shape, dtype=dtype)
        self.kv_caches = list(self.pool.unbind(0))
        self.host_caches = list(self.host_pool.unbind(0))

    def copy_blocks(self, src_to_dst: list[tuple[int, int]]) -> None:
        if not src_to_dst:
            return
        src, dst = block_id_pairs(src_to_dst, self.num_blocks, self.num_blocks, "copy_blocks")
        # index_select first: every source is read before any destination is written
        self.pool.index_copy_(2, dst, self.pool.index_select(2, src))

    def swap_out(self, device_to_host: list[tuple[int, int]]) -> None:
        if not device_to_host:
            return
        src, dst = block_id_pairs(device_to_host, self.num_blocks, self.num_host_blocks, "swap_out")
        self.host_pool.index_copy_(2, dst, self.pool.index_select(2, src))

    def swap_in(self, host_to_device: list[tuple[int, int]]) -> None:
        if not host_to_device:
            return
        src, dst = block_id_pairs(host_to_device, self.num_host_blocks, self.num_blocks, "swap_in")
        self.pool.index_copy_(2, dst, self.host_pool.index_select(2, src))

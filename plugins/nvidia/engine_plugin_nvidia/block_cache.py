"""The KV block pool in GPU memory, with a (pinned) host pool for swapping."""

from __future__ import annotations

from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine_plugin_nvidia.gpu_common.fp8_cache import FP8_CACHE_DTYPES, as_copyable
from engine_plugin_nvidia.gpu_common.gemm import to_torch_dtype
from engine_plugin_sdk.block_ids import block_id_pairs

#: the swap pool never pins more host memory than this by default (pinning is slow and scarce)
DEFAULT_MAX_HOST_BYTES = 4 * 1024**3


class CudaBlockCache(BlockCache):
    """All layers' KV blocks in one device tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``.

    Args:
        spec: cache geometry.
        num_blocks: blocks in the device pool.
        attention: its ``kv_cache_shape`` must put the block axis at position 1.
        device: where the pool lives.
        num_host_blocks: blocks in the host swap pool; default a quarter of ``num_blocks``, capped at
            :data:`DEFAULT_MAX_HOST_BYTES`, at least 1.
        pin_host: page-lock the host pool (asynchronous copies); off on the CPU.

    Raises:
        ValueError: for a non-positive block count or a layout without the block axis at 1.
    """

    supports_swap = True

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        attention: AttentionBackend,
        device: Any,
        num_host_blocks: int | None = None,
        pin_host: bool = True,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        layer_shape = tuple(attention.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim))
        if len(layer_shape) < 2 or layer_shape[1] != num_blocks:
            raise ValueError(f"CudaBlockCache needs the block axis at position 1 of the layer layout, got {layer_shape}")
        dtype = spec.dtype if spec.dtype in FP8_CACHE_DTYPES else to_torch_dtype(spec.dtype)
        self.device = torch.device(device)
        if num_host_blocks is None:
            per_block = spec.bytes_per_block(torch.empty((), dtype=dtype).element_size())
            num_host_blocks = max(1, min(num_blocks // 4, DEFAULT_MAX_HOST_BYTES // per_block))
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be at least 1, got {num_host_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        # zeros, not empty: never-written slots must not hold NaN bit patterns
        self.pool = torch.zeros((spec.num_layers, *layer_shape), dtype=dtype, device=self.device)
        host_shape = (spec.num_layers, layer_shape[0], num_host_blocks, *layer_shape[2:])
        pin = pin_host and self.device.type == "cuda"
        self.host_pool = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.kv_caches = list(self.pool.unbind(0))
        # block moves copy bytes, so that FP8 pools move too
        self._pool_bytes = as_copyable(self.pool)
        self._host_bytes = as_copyable(self.host_pool)

    def copy_blocks(self, src_to_dst: list[tuple[int, int]]) -> None:
        if not src_to_dst:
            return
        src, dst = block_id_pairs(src_to_dst, self.num_blocks, self.num_blocks, "copy_blocks")
        # gather first: every source is read before any destination is written
        pool = self._pool_bytes
        pool.index_copy_(2, dst.to(self.device), pool.index_select(2, src.to(self.device)))

    def swap_out(self, device_to_host: list[tuple[int, int]]) -> None:
        if not device_to_host:
            return
        src, dst = block_id_pairs(device_to_host, self.num_blocks, self.num_host_blocks, "swap_out")
        blocks = self._pool_bytes.index_select(2, src.to(self.device)).cpu()
        self._host_bytes.index_copy_(2, dst, blocks)

    def swap_in(self, host_to_device: list[tuple[int, int]]) -> None:
        if not host_to_device:
            return
        src, dst = block_id_pairs(host_to_device, self.num_host_blocks, self.num_blocks, "swap_in")
        blocks = self._host_bytes.index_select(2, src).to(self.device)
        self._pool_bytes.index_copy_(2, dst.to(self.device), blocks)

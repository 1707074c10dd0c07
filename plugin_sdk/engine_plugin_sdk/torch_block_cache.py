"""The one KV block pool for torch-based plugins: every layer in one tensor, a host pool for swapping.

A plugin whose attention layout puts the block axis at a fixed position of each layer's cache (the
reference, CPU, GPU and NPU backends all do) uses :class:`TorchBlockCache` as it is, or subclasses it
to change where the host pool lives.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine_plugin_sdk.block_ids import block_id_pairs
from engine_plugin_sdk.dtypes import as_copyable, torch_dtype

#: the host swap pool never takes more than this by default (pinned memory is slow to get and scarce)
DEFAULT_MAX_HOST_BYTES = 4 * 1024**3


class TorchBlockCache(BlockCache):
    """All layers' KV blocks in one tensor ``[num_layers, *layer_shape]``; per-layer views in ``kv_caches``.

    One tensor makes a copy-on-write copy or a swap a single indexed copy across every layer. Block moves
    copy bytes, so FP8 pools move too. The host pool is allocated up front: pinning gigabytes on the
    first swap would stall a serving step.

    Args:
        spec: cache geometry; ``spec.dtype`` a torch dtype or a dtype name.
        num_blocks: blocks in the device pool.
        attention: its ``kv_cache_shape`` fixes each layer's layout.
        device: where the pool lives.
        num_host_blocks: blocks in the host pool; default a quarter of ``num_blocks`` capped at
            :data:`DEFAULT_MAX_HOST_BYTES`, at least 1.
        pin_host: page-lock the host pool (only for an accelerator's pool; ignored on the CPU).
        block_axis: the block axis of one layer's layout (1 for ``[2, num_blocks, ...]``).

    Raises:
        ValueError: for a non-positive block count, an unknown dtype, or a layout whose ``block_axis``
            is not ``num_blocks`` long.
    """

    supports_swap = True

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        attention: AttentionBackend,
        device: Any = "cpu",
        num_host_blocks: int | None = None,
        pin_host: bool = False,
        block_axis: int = 1,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        layer_shape = tuple(attention.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim))
        if len(layer_shape) <= block_axis or layer_shape[block_axis] != num_blocks:
            raise ValueError(
                f"{type(self).__name__} needs the block axis at position {block_axis} of the layer layout, got {layer_shape}"
            )
        dtype = torch_dtype(spec.dtype)
        if num_host_blocks is None:
            per_block = spec.bytes_per_block(torch.empty((), dtype=dtype).element_size())
            num_host_blocks = max(1, min(num_blocks // 4, DEFAULT_MAX_HOST_BYTES // per_block))
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be at least 1, got {num_host_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.device = torch.device(device)
        self.block_axis = block_axis
        # zeros, not empty: never-written slots must not hold NaN bit patterns a masked tile could still read
        self.pool = torch.zeros((spec.num_layers, *layer_shape), dtype=dtype, device=self.device)
        self.kv_caches = list(self.pool.unbind(0))
        self._pool_bytes = as_copyable(self.pool)
        host_shape = list(self.pool.shape)
        host_shape[self._axis] = num_host_blocks
        #: the swap pool in host memory, ``num_host_blocks`` on the block axis. Not zeroed: a host block is
        #: read only after a swap-out wrote it, and pages never written are never touched (on a VM that
        #: hands memory to a process on first touch, zeroing gigabytes up front cost seconds at start-up)
        self.host_pool = torch.empty(host_shape, dtype=dtype, device="cpu", pin_memory=pin_host and self.device.type != "cpu")
        self._host_bytes = as_copyable(self.host_pool)

    @property
    def _axis(self) -> int:
        return self.block_axis + 1  # the pool's leading layer axis

    def copy_blocks(self, src_to_dst: list[tuple[int, int]]) -> None:
        if not src_to_dst:
            return
        src, dst = block_id_pairs(src_to_dst, self.num_blocks, self.num_blocks, "copy_blocks")
        pool = self._pool_bytes
        # index_select first: every source is read before any destination is written
        pool.index_copy_(self._axis, dst.to(self.device), pool.index_select(self._axis, src.to(self.device)))

    def swap_out(self, device_to_host: list[tuple[int, int]]) -> None:
        if not device_to_host:
            return
        src, dst = block_id_pairs(device_to_host, self.num_blocks, self.num_host_blocks, "swap_out")
        blocks = self._pool_bytes.index_select(self._axis, src.to(self.device)).cpu()
        self._host_bytes.index_copy_(self._axis, dst, blocks)

    def swap_in(self, host_to_device: list[tuple[int, int]]) -> None:
        if not host_to_device:
            return
        src, dst = block_id_pairs(host_to_device, self.num_host_blocks, self.num_blocks, "swap_in")
        blocks = self._host_bytes.index_select(self._axis, src).to(self.device)
        self._pool_bytes.index_copy_(self._axis, dst.to(self.device), blocks)

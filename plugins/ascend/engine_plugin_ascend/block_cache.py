"""The KV block pool in NPU memory, with a host pool for swapping out preempted sequences."""

from __future__ import annotations

import torch

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine_plugin_ascend.gemm import torch_dtype
from engine_plugin_sdk.block_ids import block_id_pairs

#: the block axis of one layer's ``[2, num_blocks, block_size, kv_heads, head_dim]`` cache
LAYER_BLOCK_AXIS = 1


class AscendBlockCache(BlockCache):
    """All layers' blocks in one device tensor ``[num_layers, 2, num_blocks, ...]``; per-layer views in ``kv_caches``.

    One tensor makes a copy-on-write copy or a swap a single indexed copy across every layer.

    Args:
        spec: cache geometry.
        num_blocks: blocks in the device pool.
        attention: fixes each layer's layout (the block axis must be axis 1).
        device: where the pool lives.
        num_host_blocks: blocks in the host swap pool (allocated on first swap); default a quarter.

    Raises:
        ValueError: for a non-positive block count or a layout without the block axis at 1.
    """

    supports_swap = True

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        attention: AttentionBackend,
        device: torch.device,
        num_host_blocks: int | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        layer_shape = tuple(
            attention.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        )
        if len(layer_shape) < 2 or layer_shape[LAYER_BLOCK_AXIS] != num_blocks:
            raise ValueError(
                f"AscendBlockCache needs the block axis at position 1 of the layout, got {layer_shape}"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_host_blocks = max(1, num_blocks // 4) if num_host_blocks is None else num_host_blocks
        if self.num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be positive, got {self.num_host_blocks}")
        self.dtype = torch_dtype(spec.dtype)
        # zeros: never-written slots must not hold NaN bit patterns that a masked tile could still read
        self.pool = torch.zeros((spec.num_layers, *layer_shape), dtype=self.dtype, device=device)
        self.kv_caches = list(self.pool.unbind(0))
        self._host_pool: torch.Tensor | None = None

    def copy_blocks(self, src_to_dst: list[tuple[int, int]]) -> None:
        if not src_to_dst:
            return
        src, dst = self._pairs(src_to_dst, self.num_blocks, self.num_blocks, "copy_blocks", self.pool.device)
        # index_select first: every source is read before any destination is written
        self.pool.index_copy_(2, dst, self.pool.index_select(2, src))

    def swap_out(self, device_to_host: list[tuple[int, int]]) -> None:
        if not device_to_host:
            return
        host = self._host()
        src, _ = self._pairs(
            device_to_host, self.num_blocks, self.num_host_blocks, "swap_out", self.pool.device
        )
        _, dst = self._pairs(device_to_host, self.num_blocks, self.num_host_blocks, "swap_out", host.device)
        host.index_copy_(2, dst, self.pool.index_select(2, src).to(host.device))

    def swap_in(self, host_to_device: list[tuple[int, int]]) -> None:
        if not host_to_device:
            return
        host = self._host()
        src, _ = self._pairs(host_to_device, self.num_host_blocks, self.num_blocks, "swap_in", host.device)
        _, dst = self._pairs(
            host_to_device, self.num_host_blocks, self.num_blocks, "swap_in", self.pool.device
        )
        self.pool.index_copy_(2, dst, host.index_select(2, src).to(self.pool.device))

    def _host(self) -> torch.Tensor:
        # allocated on first swap: most runs never preempt by swapping
        if self._host_pool is None:
            shape = list(self.pool.shape)
            shape[2] = self.num_host_blocks
            pin = self.pool.device.type != "cpu"
            self._host_pool = torch.zeros(shape, dtype=self.dtype, device="cpu", pin_memory=pin)
        return self._host_pool

    @staticmethod
    def _pairs(
        pairs: list[tuple[int, int]], src_limit: int, dst_limit: int, what: str, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = block_id_pairs(pairs, src_limit, dst_limit, what)
        return src.to(device), dst.to(device)

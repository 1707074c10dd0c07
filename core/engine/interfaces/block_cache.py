"""The KV block pool contract: allocation within a budget, copy-on-write copies, swapping to host."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of the paged KV cache of one model.

    Attributes:
        num_layers: decoder layers, each with its own cache tensor.
        num_kv_heads: key/value heads per layer.
        head_dim: size of one head.
        block_size: tokens per block.
        dtype: element dtype of the cache (a torch dtype for torch backends).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: Any

    def bytes_per_block(self, element_size: int) -> int:
        """Bytes one block takes across all layers, keys and values."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size


class BlockCache(ABC):
    """Owns the physical KV blocks of every layer.

    Attributes:
        num_blocks: physical blocks in the pool (same ids in every layer).
        kv_caches: one cache tensor per layer, shaped by the attention backend.
    """

    #: whether :meth:`swap_out` / :meth:`swap_in` are implemented
    supports_swap: bool = False
    #: blocks in the host-memory swap pool (0 when swapping is unsupported)
    num_host_blocks: int = 0

    num_blocks: int
    kv_caches: list[Any]

    @abstractmethod
    def copy_blocks(self, src_to_dst: list[tuple[int, int]]) -> None:
        """Copy whole blocks within the pool, in every layer (copy-on-write).

        Args:
            src_to_dst: pairs of physical block ids.
        """

    def swap_out(self, device_to_host: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks (preemption by swapping).

        Args:
            device_to_host: pairs of (device block id, host block id).

        Raises:
            NotImplementedError: if :attr:`supports_swap` is false.
        """
        raise NotImplementedError

    def swap_in(self, host_to_device: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks.

        Args:
            host_to_device: pairs of (host block id, device block id).

        Raises:
            NotImplementedError: if :attr:`supports_swap` is false.
        """
        raise NotImplementedError


def apply_block_moves(
    cache: BlockCache,
    swap_out: list[tuple[int, int]],
    copies: list[tuple[int, int]],
    swap_in: list[tuple[int, int]],
) -> None:
    """A step's block moves, in the one order that is safe: a block a swap-out or a copy-on-write frees may be
    reused by a swap-in of the same step, so swap-outs go first, then copies, then swap-ins.

    Args:
        cache: the pool.
        swap_out: ``(device block, host block)`` pairs.
        copies: ``(source, destination)`` device block pairs.
        swap_in: ``(host block, device block)`` pairs.
    """
    if swap_out:
        cache.swap_out(swap_out)
    if copies:
        cache.copy_blocks(copies)
    if swap_in:
        cache.swap_in(swap_in)

"""Block tables for a model with KV groups (see :mod:`engine.kv_groups`): one table per group per sequence.

:class:`HybridBlockManager` offers what the scheduler, the runner and the engine use of a
:class:`~engine.block_manager.BlockManager`, over one :class:`BlockManager` per group that all draw from
one allocator. A sequence holds a table in every group; growing it, copying on write, forking and freeing
act on every group; a sliding group releases the blocks that fall out of its window. A prefix-cache hit
must hold in every group at once (each group caches its own blocks under its own keys), so the sequence
takes the longest prefix every group can serve. Swapping to host memory is not offered: preemption
recomputes.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.block_allocator import BlockAllocator, NoFreeBlocksError
from engine.block_manager import BlockManager
from engine.prefix_hash import PrefixCacheStats


class HybridBlockManager:
    """One block table per KV group for every sequence, over one shared pool.

    Args:
        num_blocks: physical blocks in the pool (each as large as a group's layers).
        block_size: tokens per block.
        windows: each group's attention window (None: global), in group order.
        enable_prefix_caching: share full blocks of identical prefixes between sequences.
    """

    def __init__(
        self, num_blocks: int, block_size: int, windows: list[int | None], enable_prefix_caching: bool = False
    ) -> None:
        if len(windows) < 2:
            raise ValueError("a hybrid block manager needs at least two KV groups")
        if num_blocks < 2:
            raise ValueError("a model with sliding-window layers needs at least two KV blocks (one is the null block)")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        #: the block released table entries point at (shared by every group); never handed out
        self.null_block: int | None = self.allocator.allocate()
        shared = (self.allocator, self.null_block)
        self._groups = tuple(
            BlockManager(num_blocks, block_size, enable_prefix_caching, window, shared=shared, group=index)
            for index, window in enumerate(windows)
        )
        self.prefix_stats = PrefixCacheStats()

    # --- sizes ---------------------------------------------------------------------------------------

    @property
    def groups(self) -> tuple[BlockManager, ...]:
        """The per-group managers, in group order."""
        return self._groups

    @property
    def releases_blocks(self) -> bool:
        return any(group.releases_blocks for group in self._groups)

    @property
    def num_total_blocks(self) -> int:
        """Blocks sequences can use (the null block is not one)."""
        return self.allocator.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def num_window_releases(self) -> int:
        return sum(group.num_window_releases for group in self._groups)

    # --- growth, copies, forks -------------------------------------------------------------------------

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """New blocks ``seq_id`` needs, across its groups, so its tables cover ``num_tokens`` tokens."""
        return sum(group.blocks_needed(seq_id, num_tokens) for group in self._groups)

    def can_allocate(self, seq_id: int, num_tokens: int, reserve: int = 0, num_computed: int | None = None) -> bool:
        """See :meth:`BlockManager.can_allocate`; a reserve is counted once per group."""
        need = self.blocks_needed(seq_id, num_tokens) + reserve * len(self._groups)
        if num_computed is not None:
            need += sum(group._shared_block_at(seq_id, num_computed) is not None for group in self._groups)
        return need <= self.num_free_blocks

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow every group's table of ``seq_id`` to cover ``num_tokens`` tokens; returns the new blocks.

        Raises:
            NoFreeBlocksError: if the pool cannot cover it (nothing is allocated then).
        """
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {need} blocks, {self.num_free_blocks} free")
        return [block for group in self._groups for block in group.allocate(seq_id, num_tokens)]

    def has_private_slot(self, seq_id: int, position: int) -> bool:
        return all(group.has_private_slot(seq_id, position) for group in self._groups)

    def copies_for_write(self, seq_id: int, position: int) -> list[tuple[int, int]]:
        """Private copies of the shared blocks ``position`` is written to, in every group."""
        return [copy for group in self._groups for copy in group.copies_for_write(seq_id, position)]

    def fork(self, parent_id: int, child_id: int) -> None:
        for group in self._groups:
            group.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        for group in self._groups:
            group.free(seq_id)

    def release_out_of_window(self, seq_id: int, first_query_position: int) -> int:
        """Release, in every sliding group, the blocks no query from ``first_query_position`` on sees."""
        return sum(group.release_out_of_window(seq_id, first_query_position) for group in self._groups)

    # --- prefix caching ------------------------------------------------------------------------------

    def match_prefix(self, seq_id: int, token_ids: list[int], extra_key: object = None) -> int:
        """The longest cached prefix every group can serve, taken in every group (see
        :meth:`BlockManager.match_prefix`); returns its length in tokens."""
        if not self.enable_prefix_caching or any(group.block_tables.get(seq_id) for group in self._groups):
            return 0
        lookups = [group.lookup_prefix(token_ids, extra_key) for group in self._groups]
        longest = min(len(found) for _, found in lookups)
        k = next(
            (k for k in range(longest, 0, -1) if all(g.can_take(found, k) for g, (_, found) in zip(self._groups, lookups))),
            0,
        )
        for group, (hashes, found) in zip(self._groups, lookups):
            group.take_prefix(seq_id, hashes, found, k)
        self.prefix_stats.queried_tokens += len(token_ids)
        self.prefix_stats.hit_tokens += k * self.block_size
        return k * self.block_size

    def register_computed(
        self, seq_id: int, token_slice: Callable[[int, int], list[int]], num_computed: int, extra_key: object = None
    ) -> None:
        for group in self._groups:
            group.register_computed(seq_id, token_slice, num_computed, extra_key)

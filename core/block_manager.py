"""Paged KV memory bookkeeping: a free list of fixed-size blocks, reference counts, per-sequence block tables.

Pure Python and device-free: it hands out block ids; the platform's BlockCache owns the memory behind them.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation is attempted with an empty free list (callers check capacity first)."""


class BlockAllocator:
    """Physical block ids ``0..num_blocks-1`` with reference counts.

    Freed blocks go to the back of the free list, so ids are reused in a predictable order.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError("no free KV blocks")
        block = self._free.popleft()
        self._ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self._ref_counts[block] < 1:
            raise ValueError(f"block {block} is free; cannot share it")
        self._ref_counts[block] += 1

    def decref(self, block: int) -> None:
        count = self._ref_counts[block]
        if count < 1:
            raise ValueError(f"block {block} freed twice")
        self._ref_counts[block] = count - 1
        if count == 1:
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]


class BlockManager:
    """Maps each sequence to the physical blocks holding its KV cache.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[int, list[int]] = {}

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """New blocks ``seq_id`` needs so its table covers ``num_tokens`` tokens."""
        have = len(self.block_tables.get(seq_id, ()))
        need = -(-num_tokens // self.block_size)
        return max(0, need - have)

    def can_allocate(self, seq_id: int, num_tokens: int, reserve: int = 0) -> bool:
        """Whether the table of ``seq_id`` can grow to ``num_tokens`` tokens leaving ``reserve`` blocks free."""
        return self.blocks_needed(seq_id, num_tokens) + reserve <= self.num_free_blocks

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow the table of ``seq_id`` to cover ``num_tokens`` tokens; returns the new block ids.

        Raises:
            NoFreeBlocksError: if the pool cannot cover it (nothing is allocated then).
        """
        n = self.blocks_needed(seq_id, num_tokens)
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {n} blocks, {self.num_free_blocks} free")
        table = self.block_tables.setdefault(seq_id, [])
        new = [self.allocator.allocate() for _ in range(n)]
        table.extend(new)
        return new

    def fork(self, parent_id: int, child_id: int) -> None:
        """Let ``child_id`` share every block of ``parent_id`` (reference counted)."""
        table = self.block_tables[parent_id]
        for block in table:
            self.allocator.incref(block)
        self.block_tables[child_id] = list(table)

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id``; unknown ids are ignored (a sequence may never have run)."""
        for block in self.block_tables.pop(seq_id, []):
            self.allocator.decref(block)

    def slot(self, seq_id: int, position: int) -> int:
        """The cache slot of token ``position`` of ``seq_id``."""
        table = self.block_tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

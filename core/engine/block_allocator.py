"""Physical KV block ids: a free list, reference counts and the prefix cache's content index.

Free blocks come from two places: never-cached blocks (a FIFO, so ids are reused predictably) and cached
blocks nobody references (an LRU, evicted oldest first once the FIFO is empty).
"""

from __future__ import annotations

from collections import OrderedDict, deque


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation is attempted with no free block (callers check capacity first)."""


class BlockAllocator:
    """Physical block ids ``0..num_blocks-1`` with reference counts and a content-hash index.

    Free blocks come from two places: never-cached blocks (a FIFO, so ids are reused predictably) and
    cached blocks nobody references (an LRU, evicted oldest first once the FIFO is empty).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        # block -> (its hash, the content it was hashed from); hash -> block
        self._entry_of: dict[int, tuple[bytes, bytes]] = {}
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._entry_of.pop(block)[0]]
            self.num_evictions += 1
        else:
            raise NoFreeBlocksError("no free KV blocks")
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
            if block in self._entry_of:
                self._evictable[block] = None  # most recently used at the end
            else:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def lookup(self, block_hash: bytes, content: bytes) -> int | None:
        """The block registered under ``block_hash``, if its content is ``content``.

        Args:
            block_hash: the hash of ``content``.
            content: what the block was hashed from (see :func:`block_content`).

        Returns:
            The block id, or None when nothing is registered under the hash or the registered block's
            content differs (a collision: never shared).
        """
        block = self._block_of.get(block_hash)
        if block is None or self._entry_of[block][1] != content:
            return None
        return block

    def acquire_cached(self, block: int) -> None:
        """Take a reference to a cached block, reviving it from the LRU list if unreferenced."""
        if self._ref_counts[block] == 0:
            del self._evictable[block]
        self._ref_counts[block] += 1

    def register(self, block: int, block_hash: bytes, content: bytes) -> None:
        """Index a full block by its content hash, keeping the content to check lookups against.

        A block already indexed under the same hash wins (an identical block, or, for a collision, the
        first one: the other is then simply not cached).
        """
        if block_hash in self._block_of or block in self._entry_of:
            return
        self._block_of[block_hash] = block
        self._entry_of[block] = (block_hash, content)

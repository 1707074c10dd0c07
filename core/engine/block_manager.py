"""Paged KV memory bookkeeping: free list, reference counts, block tables, prefix cache, copy-on-write.

Pure Python and device-free: it hands out block ids; the platform's BlockCache owns the memory behind them.

Prefix caching: once a block is full, it is registered under a chained hash of (hash of the previous block,
its token ids, an extra key such as an adapter id), so the same tokens after a different prefix never match.
A later sequence whose prompt starts with the same blocks takes them by reference instead of computing
them. A cached block whose last user is gone is not forgotten: it waits in an LRU list, still counted as
free, until an allocation needs it and evicts the least recently used one. (The hash is Python's 64-bit
tuple hash: a collision would need two different token blocks to agree on 64 bits.)
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass


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
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
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
            del self._block_of[self._hash_of.pop(block)]
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
            if block in self._hash_of:
                self._evictable[block] = None  # most recently used at the end
            else:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def lookup(self, block_hash: int) -> int | None:
        """The block registered under ``block_hash``, if any."""
        return self._block_of.get(block_hash)

    def acquire_cached(self, block: int) -> None:
        """Take a reference to a cached block, reviving it from the LRU list if unreferenced."""
        if self._ref_counts[block] == 0:
            del self._evictable[block]
        self._ref_counts[block] += 1

    def register(self, block: int, block_hash: int) -> None:
        """Index a full block by its content hash; an identical block already indexed wins."""
        if block_hash in self._block_of or block in self._hash_of:
            return
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash


def chain_hash(parent: int | None, tokens: tuple[int, ...], extra_key: object = None) -> int:
    """The prefix-cache key of a full block: it depends on every token before it."""
    return hash((parent, tokens, extra_key))


@dataclass(slots=True)
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were found."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    """Maps each sequence to the physical blocks holding its KV cache.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks of identical prefixes between sequences.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self._hashes: dict[int, list[int]] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """New blocks ``seq_id`` needs so its table covers ``num_tokens`` tokens."""
        have = len(self.block_tables.get(seq_id, ()))
        need = -(-num_tokens // self.block_size)
        return max(0, need - have)

    def can_allocate(self, seq_id: int, num_tokens: int, reserve: int = 0, num_computed: int | None = None) -> bool:
        """Whether ``seq_id`` can grow to ``num_tokens`` tokens (plus a copy-on-write copy if writing at
        ``num_computed`` needs one), leaving ``reserve`` blocks free."""
        cow = 1 if num_computed is not None and self._shared_block_at(seq_id, num_computed) is not None else 0
        return self.blocks_needed(seq_id, num_tokens) + cow + reserve <= self.num_free_blocks

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

    def has_private_slot(self, seq_id: int, position: int) -> bool:
        """Whether token ``position`` of ``seq_id`` can be written now: its block is allocated and not
        shared (the common decode step, which then needs neither a new block nor a copy)."""
        table = self.block_tables.get(seq_id)
        index = position // self.block_size
        return table is not None and index < len(table) and self.allocator.ref_count(table[index]) == 1

    def _shared_block_at(self, seq_id: int, position: int) -> int | None:
        table = self.block_tables.get(seq_id)
        index = position // self.block_size
        if table is None or index >= len(table):
            return None
        return index if self.allocator.ref_count(table[index]) > 1 else None

    def copy_on_write(self, seq_id: int, position: int) -> tuple[int, int] | None:
        """Before writing token ``position`` of ``seq_id``: if its block is shared, give the sequence a
        private copy. Returns the ``(source, destination)`` blocks to copy, or None if no copy is needed.
        """
        index = self._shared_block_at(seq_id, position)
        if index is None:
            return None
        table = self.block_tables[seq_id]
        src = table[index]
        dst = self.allocator.allocate()
        self.allocator.decref(src)
        table[index] = dst
        return src, dst

    def fork(self, parent_id: int, child_id: int) -> None:
        """Let ``child_id`` share every block of ``parent_id`` (reference counted)."""
        table = self.block_tables[parent_id]
        for block in table:
            self.allocator.incref(block)
        self.block_tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes.get(parent_id, ()))

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id``; unknown ids are ignored (a sequence may never have run).

        Blocks are released last-first so that, among equally old cached blocks, a prefix's first
        blocks are evicted last.
        """
        self._hashes.pop(seq_id, None)
        for block in reversed(self.block_tables.pop(seq_id, [])):
            self.allocator.decref(block)

    def slot(self, seq_id: int, position: int) -> int:
        """The cache slot of token ``position`` of ``seq_id``."""
        table = self.block_tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # --- prefix caching --------------------------------------------------------------------------

    def match_prefix(self, seq_id: int, token_ids: list[int], extra_key: object = None) -> int:
        """Give a sequence with no blocks yet the cached blocks of its longest cached prefix.

        At least one token is always left uncomputed, so the step that finishes the prompt has a row
        to sample from.

        Returns:
            How many leading tokens are already in the cache (a multiple of the block size).
        """
        if not self.enable_prefix_caching or self.block_tables.get(seq_id):
            return 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        parent: int | None = None
        hashes: list[int] = []
        blocks: list[int] = []
        for j in range(max_blocks):
            h = chain_hash(parent, tuple(token_ids[j * bs : (j + 1) * bs]), extra_key)
            block = self.allocator.lookup(h)
            if block is None:
                break
            self.allocator.acquire_cached(block)
            hashes.append(h)
            blocks.append(block)
            parent = h
        self.prefix_stats.queried_tokens += len(token_ids)
        self.prefix_stats.hit_tokens += len(blocks) * bs
        if blocks:
            self.block_tables[seq_id] = blocks
            self._hashes[seq_id] = hashes
        return len(blocks) * bs

    def register_computed(
        self, seq_id: int, token_slice: Callable[[int, int], list[int]], num_computed: int, extra_key: object = None
    ) -> None:
        """Index the sequence's blocks that became full now that ``num_computed`` tokens are in the cache.

        Args:
            token_slice: returns the sequence's tokens ``[start, end)``.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self._hashes.setdefault(seq_id, [])
        table = self.block_tables[seq_id]
        full = min(num_computed // bs, len(table))
        parent = hashes[-1] if hashes else None
        for j in range(len(hashes), full):
            h = chain_hash(parent, tuple(token_slice(j * bs, (j + 1) * bs)), extra_key)
            self.allocator.register(table[j], h)
            hashes.append(h)
            parent = h

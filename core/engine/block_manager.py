"""Paged KV memory bookkeeping: free list, reference counts, block tables, prefix cache, copy-on-write.

Pure Python and device-free: it hands out block ids; the platform's BlockCache owns the memory behind them.

Prefix caching: once a block is full, it is registered under a chained hash of its content: the hash of
the previous block (a fixed root value for the first), its index, its token ids packed as little-endian
int64, and an extra key (an adapter id, a request's cache salt), so the same tokens after a different
prefix never match. The hash is SHA-256 (faster than BLAKE2b on this kind of CPU for a block's ~160 bytes;
``benchmarks/prefix_hash_cost.py`` measures it), and a lookup also compares the stored content with the
looked-up one, so even a hash collision cannot hand a sequence another prefix's KV. A later sequence whose
prompt starts with the same blocks takes them by reference instead of computing them. A cached block
whose last user is gone is not forgotten: it waits in an LRU list, still counted as free, until an
allocation needs it and evicts the least recently used one.

Sliding windows: when every layer of the model attends over the same window of ``W`` tokens, a block whose
tokens all lie before the window of a sequence's next query is never read again. Its table entry then
points at the *null block* (a block reserved up front, never written, so it holds zeros) and the block
goes back to the pool (or, if it is in the prefix cache, to the LRU list), so a long sequence holds about
``W / block_size`` blocks however long it grows. Attention backends honour the window, so they never let
an entry before it affect the output (see ``AttentionMetadata.sliding_window``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from engine.block_allocator import BlockAllocator, NoFreeBlocksError
from engine.prefix_hash import ROOT_HASH, PrefixCacheStats, block_content, content_hash, encode_extra_key

__all__ = [
    "ROOT_HASH", "BlockAllocator", "BlockManager", "NoFreeBlocksError", "PrefixCacheStats", "block_content",
    "content_hash", "encode_extra_key",
]


class BlockManager:
    """Maps each sequence to the physical blocks holding its KV cache.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks of identical prefixes between sequences.
        sliding_window: the window every layer attends over, or None; when set, blocks that fall out of
            a sequence's window are released (one block of the pool is then reserved as the null block).
        shared: the allocator and null block of a pool this manager shares with others (one per KV group,
            see :class:`engine.hybrid_block_manager.HybridBlockManager`); ``num_blocks`` is then ignored.
        group: the KV group this manager keeps tables for; part of its prefix-cache keys, so groups sharing
            an allocator never take each other's blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        shared: tuple[BlockAllocator, int | None] | None = None,
        group: int = 0,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.group = group
        if shared is not None:
            self.allocator, null = shared
            if sliding_window is not None and null is None:
                raise ValueError("a sliding-window group needs the pool's null block")
        else:
            if sliding_window is not None and num_blocks < 2:
                raise ValueError("a sliding-window model needs at least two KV blocks (one is the null block)")
            self.allocator = BlockAllocator(num_blocks)
            null = self.allocator.allocate() if sliding_window is not None else None
        #: the block out-of-window table entries point at; never handed out, never written
        self.null_block: int | None = null
        self.block_tables: dict[int, list[int]] = {}
        self._hashes: dict[int, list[bytes]] = {}
        # per sequence under a window: table entries below this index are the null block
        self._released: dict[int, int] = {}
        self.prefix_stats = PrefixCacheStats()
        self.num_window_releases = 0
        # a full block's token ids as little-endian int64 (fixed width, whatever the platform)
        self._pack_tokens = struct.Struct(f"<{block_size}q").pack

    @property
    def groups(self) -> tuple[BlockManager, ...]:
        """The per-group managers whose tables a step's metadata is built from: this one alone."""
        return (self,)

    @property
    def releases_blocks(self) -> bool:
        """Whether :meth:`release_out_of_window` can free anything (the scheduler calls it only then)."""
        return self.sliding_window is not None

    @property
    def num_total_blocks(self) -> int:
        """Blocks sequences can use (the null block, when reserved, is not one)."""
        return self.allocator.num_blocks - (self.null_block is not None)

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

    def allocate_entries(self, seq_id: int, live: list[bool]) -> list[int]:
        """Give ``seq_id``, which holds no blocks, a table of ``len(live)`` entries: a new block where
        ``live`` is True, the null block elsewhere (a sequence coming back from host memory whose early
        blocks were released out of its window).

        Returns:
            The new blocks, in table order.

        Raises:
            NoFreeBlocksError: if the pool cannot cover it (nothing is allocated then).
            ValueError: the sequence already holds blocks, or an entry is not live without a window.
        """
        if self.block_tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if not all(live) and self.null_block is None:
            raise ValueError("only a sliding-window block manager has released entries")
        need = sum(live)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {need} blocks, {self.num_free_blocks} free")
        table = [self.allocator.allocate() if keep else self.null_block for keep in live]
        self.block_tables[seq_id] = table  # type: ignore[assignment]
        released = 0
        while released < len(live) and not live[released]:
            released += 1
        if released:
            self._released[seq_id] = released
        return [block for block, keep in zip(table, live) if keep]  # type: ignore[misc]

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

    def copies_for_write(self, seq_id: int, position: int) -> list[tuple[int, int]]:
        """:meth:`copy_on_write` as a list (empty, or the one copy), as every block manager returns it."""
        copy = self.copy_on_write(seq_id, position)
        return [] if copy is None else [copy]

    def fork(self, parent_id: int, child_id: int) -> None:
        """Let ``child_id`` share every block of ``parent_id`` (reference counted)."""
        table = self.block_tables[parent_id]
        for block in table:
            if block != self.null_block:
                self.allocator.incref(block)
        self.block_tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes.get(parent_id, ()))
        if parent_id in self._released:
            self._released[child_id] = self._released[parent_id]

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id``; unknown ids are ignored (a sequence may never have run).

        Blocks are released last-first so that, among equally old cached blocks, a prefix's first
        blocks are evicted last.
        """
        self._hashes.pop(seq_id, None)
        self._released.pop(seq_id, None)
        for block in reversed(self.block_tables.pop(seq_id, [])):
            if block != self.null_block:
                self.allocator.decref(block)

    def release_out_of_window(self, seq_id: int, first_query_position: int) -> int:
        """Release the blocks of ``seq_id`` that no query at or after ``first_query_position`` can see.

        A query at position ``p`` sees positions ``> p - sliding_window``, so a block whose last position is
        at most ``first_query_position - sliding_window`` is never read again; its table entry becomes the
        null block. Without a window this does nothing.

        Args:
            seq_id: the sequence.
            first_query_position: the position of the first token the sequence's next step computes.

        Returns:
            How many blocks were released.
        """
        if self.sliding_window is None:
            return 0
        table = self.block_tables.get(seq_id)
        if not table:
            return 0
        # blocks [0, stop) end at or before the window's start
        stop = min(len(table), max(0, first_query_position - self.sliding_window + 1) // self.block_size)
        start = self._released.get(seq_id, 0)
        if stop <= start:
            return 0
        null = self.null_block
        assert null is not None
        released = 0
        for j in range(start, stop):
            block = table[j]
            if block != null:
                self.allocator.decref(block)
                table[j] = null
                released += 1
        self._released[seq_id] = stop
        self.num_window_releases += released
        return released

    def slot(self, seq_id: int, position: int) -> int:
        """The cache slot of token ``position`` of ``seq_id``."""
        table = self.block_tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # --- prefix caching --------------------------------------------------------------------------

    def match_prefix(self, seq_id: int, token_ids: list[int], extra_key: object = None) -> int:
        """Give a sequence with no blocks yet the cached blocks of its longest cached prefix.

        At least one token is always left uncomputed, so the step that finishes the prompt has a row
        to sample from.

        Args:
            seq_id: the sequence, which must hold no blocks yet (else nothing is matched).
            token_ids: its tokens.
            extra_key: what else the KV depends on (see :func:`encode_extra_key`): only blocks registered
                with an equal key are shared (a request's cache salt keeps its blocks to its peers).

        Returns:
            How many leading tokens are already in the cache (a multiple of the block size).
        """
        if not self.enable_prefix_caching or self.block_tables.get(seq_id):
            return 0
        hashes, found = self.lookup_prefix(token_ids, extra_key)
        num_blocks = next((k for k in range(len(found), 0, -1) if self.can_take(found, k)), 0)
        self.prefix_stats.queried_tokens += len(token_ids)
        self.prefix_stats.hit_tokens += num_blocks * self.block_size
        self.take_prefix(seq_id, hashes, found, num_blocks)
        return num_blocks * self.block_size

    def lookup_prefix(self, token_ids: list[int], extra_key: object = None) -> tuple[list[bytes], list[int | None]]:
        """The chained hashes of the prompt's full blocks (all but its last token) and the cached block
        of each (None: not cached); without a window the lists stop at the first miss."""
        bs = self.block_size
        extra = encode_extra_key(extra_key if self.group == 0 else (self.group, extra_key))
        parent = ROOT_HASH
        hashes: list[bytes] = []
        found: list[int | None] = []
        for j in range((len(token_ids) - 1) // bs):
            content = block_content(parent, j, self._pack_tokens(*token_ids[j * bs : (j + 1) * bs]), extra)
            h = content_hash(content)
            block = self.allocator.lookup(h, content)
            if block is None and self.sliding_window is None:
                break  # without a window every block of the prefix is needed
            hashes.append(h)
            found.append(block)
            parent = h
        return hashes, found

    def can_take(self, found: list[int | None], k: int) -> bool:
        """Whether a sequence can start with the first ``k`` blocks of a lookup: every block its next
        query sees is cached (under a window, blocks before that window need not be)."""
        return k <= len(found) and all(block is not None for block in found[self._first_visible_block(k * self.block_size) : k])

    def take_prefix(self, seq_id: int, hashes: list[bytes], found: list[int | None], k: int) -> None:
        """Give ``seq_id`` (holding no blocks) the first ``k`` blocks of a lookup (see :meth:`can_take`)."""
        if not k:
            return
        first_live = self._first_visible_block(k * self.block_size)
        table: list[int] = []
        for j in range(k):
            block = self.null_block if j < first_live else found[j]
            assert block is not None
            if j >= first_live:
                self.allocator.acquire_cached(block)
            table.append(block)
        self.block_tables[seq_id] = table
        self._hashes[seq_id] = hashes[:k]
        if first_live:
            self._released[seq_id] = first_live

    def _first_visible_block(self, first_query_position: int) -> int:
        """Index of the first block a query at ``first_query_position`` (or later) can see."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query_position - self.sliding_window + 1) // self.block_size

    def register_computed(
        self, seq_id: int, token_slice: Callable[[int, int], list[int]], num_computed: int, extra_key: object = None
    ) -> None:
        """Index the sequence's blocks that became full now that ``num_computed`` tokens are in the cache.

        Args:
            token_slice: returns the sequence's tokens ``[start, end)``.
            extra_key: the key the sequence matched its prefix with (see :meth:`match_prefix`).
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self._hashes.setdefault(seq_id, [])
        table = self.block_tables[seq_id]
        full = min(num_computed // bs, len(table))
        if len(hashes) >= full:
            return  # the common decode step: no block became full
        extra = encode_extra_key(extra_key if self.group == 0 else (self.group, extra_key))
        parent = hashes[-1] if hashes else ROOT_HASH
        for j in range(len(hashes), full):
            content = block_content(parent, j, self._pack_tokens(*token_slice(j * bs, (j + 1) * bs)), extra)
            h = content_hash(content)
            if table[j] != self.null_block:
                self.allocator.register(table[j], h, content)
            hashes.append(h)
            parent = h

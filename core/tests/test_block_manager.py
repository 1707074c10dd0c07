from __future__ import annotations

import pytest

from engine.block_manager import BlockAllocator, BlockManager, NoFreeBlocksError


def test_allocator_hands_out_ids_in_order_and_reuses_freed_ones_last():
    a = BlockAllocator(4)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    assert a.num_free_blocks == 1
    a.decref(1)
    assert a.num_free_blocks == 2
    assert a.allocate() == 3
    assert a.allocate() == 1
    with pytest.raises(NoFreeBlocksError):
        a.allocate()


def test_reference_counts_keep_shared_blocks_alive():
    a = BlockAllocator(2)
    b = a.allocate()
    a.incref(b)
    assert a.ref_count(b) == 2
    a.decref(b)
    assert a.num_free_blocks == 1
    a.decref(b)
    assert a.num_free_blocks == 2
    with pytest.raises(ValueError, match="freed twice"):
        a.decref(b)
    with pytest.raises(ValueError, match="is free"):
        a.incref(b)


def test_block_tables_grow_per_token_count_with_exact_ids():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate(seq_id=0, num_tokens=5) == [0, 1]
    assert bm.allocate(seq_id=1, num_tokens=4) == [2]
    assert bm.allocate(seq_id=0, num_tokens=8) == []  # still fits in two blocks
    assert bm.allocate(seq_id=0, num_tokens=9) == [3]
    assert bm.block_tables == {0: [0, 1, 3], 1: [2]}
    assert bm.num_free_blocks == 4
    assert bm.slot(0, 0) == 0
    assert bm.slot(0, 5) == 1 * 4 + 1
    assert bm.slot(0, 8) == 3 * 4 + 0
    bm.free(0)
    assert bm.num_free_blocks == 7
    assert bm.allocate(seq_id=2, num_tokens=16) == [4, 5, 6, 7]
    assert bm.allocate(seq_id=3, num_tokens=12) == [3, 1, 0]  # released last block first
    assert bm.num_free_blocks == 0


def test_failed_allocation_allocates_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate(0, 8)
    assert not bm.can_allocate(1, 9)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1, 9)
    assert bm.num_free_blocks == 1
    assert 1 not in bm.block_tables or bm.block_tables[1] == []


def test_fork_shares_blocks_until_both_are_freed():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate(0, 3)
    bm.fork(0, 1)
    assert bm.block_tables[1] == [0, 1]
    assert bm.num_free_blocks == 2
    bm.free(0)
    assert bm.num_free_blocks == 2
    bm.free(1)
    assert bm.num_free_blocks == 4


def test_reserve_is_honoured():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.can_allocate(0, 8, reserve=1)
    assert not bm.can_allocate(0, 12, reserve=1)


def test_private_slot_means_allocated_and_unshared():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert not bm.has_private_slot(1, 0)  # no table yet
    assert bm.allocate(1, 6) == [0, 1]
    assert bm.has_private_slot(1, 5) and bm.has_private_slot(1, 7)
    assert not bm.has_private_slot(1, 8)  # past the table: needs a new block
    bm.fork(1, 2)
    assert not bm.has_private_slot(1, 5) and not bm.has_private_slot(2, 5)  # shared: copy-on-write first
    assert bm.copy_on_write(2, 5) == (1, 2)
    assert bm.has_private_slot(1, 5) and bm.has_private_slot(2, 5)
    assert not bm.has_private_slot(2, 1)  # block 0 is still shared

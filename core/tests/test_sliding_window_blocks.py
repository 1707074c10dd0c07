"""Sliding windows free memory: blocks that fall out of every layer's window go back to the pool.

Unit checks of the block manager and the scheduler, then a tiny Mistral with an 8-token window run
through ``LLM`` on a pool far smaller than its sequences, against HF transformers' greedy tokens.
"""

from __future__ import annotations

import pytest
from dense_model_utils import hf_greedy, load_hf, save_tiny

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager, NoFreeBlocksError
from engine.config import SchedulerConfig
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine_test_utils import assert_all_blocks_free


def test_blocks_before_the_window_are_released_to_the_null_block():
    bm = BlockManager(num_blocks=9, block_size=4, sliding_window=8)
    assert bm.null_block == 0 and bm.num_total_blocks == 8 and bm.num_free_blocks == 8
    bm.allocate(1, 20)  # five blocks, positions 0..19
    assert bm.num_free_blocks == 3
    # a query at 20 sees positions 13..20: blocks 0-2 (positions 0..11) are never read again
    assert bm.release_out_of_window(1, 20) == 3
    assert bm.block_tables[1] == [0, 0, 0, 4, 5]
    assert bm.num_free_blocks == 6 and bm.num_window_releases == 3
    assert bm.release_out_of_window(1, 20) == 0  # idempotent
    assert bm.release_out_of_window(1, 21) == 0  # position 12 (block 3) is still visible from 20..
    assert bm.release_out_of_window(1, 24) == 1
    bm.free(1)
    assert bm.num_free_blocks == 8 and bm.block_tables == {}


def test_without_a_window_nothing_is_released_or_reserved():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 16)
    assert bm.null_block is None and bm.release_out_of_window(1, 1000) == 0
    assert bm.block_tables[1] == [0, 1, 2, 3]


def test_fork_and_free_skip_the_null_block():
    bm = BlockManager(num_blocks=8, block_size=4, sliding_window=4)
    bm.allocate(1, 16)
    bm.release_out_of_window(1, 16)  # sees 13..16: blocks 0-2 released
    bm.fork(1, 2)
    assert bm.block_tables[2] == bm.block_tables[1] == [0, 0, 0, 4]
    assert bm.allocator.ref_count(4) == 2
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == bm.num_total_blocks == 7


def test_allocate_entries_restores_a_table_with_released_entries():
    bm = BlockManager(num_blocks=6, block_size=4, sliding_window=4)
    new = bm.allocate_entries(3, [False, False, True, True])
    assert bm.block_tables[3] == [0, 0, *new] and len(set(new)) == 2
    assert bm.release_out_of_window(3, 12) == 0  # already released below block 2
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_entries(4, [True] * 4)
    with pytest.raises(ValueError, match="only a sliding-window"):
        BlockManager(num_blocks=4, block_size=4).allocate_entries(1, [False, True])


def test_prefix_cache_hit_needs_only_the_blocks_inside_the_window():
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True, sliding_window=6)
    tokens = list(range(100, 125))  # 25 tokens: 6 full blocks can be matched
    bm.allocate(1, 25)
    bm.register_computed(1, lambda a, b: tokens[a:b], 25)
    table = list(bm.block_tables[1])
    bm.free(1)  # all six full blocks stay cached (LRU)
    for block in table[2:6]:  # use blocks 2-5 again, so that blocks 0 and 1 are the least recently used
        bm.allocator.acquire_cached(block)
        bm.allocator.decref(block)
    # take every never-cached block, then two cached ones: blocks 0 and 1 are evicted
    hold = [bm.allocator.allocate() for _ in range(bm.allocator.num_free_blocks - 6 + 2)]
    assert bm.allocator.num_evictions == 2
    hit = bm.match_prefix(2, tokens)
    # the first query is at 24 and sees 19..24: blocks 4 and 5 must be cached, blocks 0-3 need not be
    assert hit == 24
    assert bm.block_tables[2][:4] == [bm.null_block] * 4
    for block in hold:
        bm.allocator.decref(block)
    bm.free(2)
    assert bm.num_free_blocks == bm.num_total_blocks


def _seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(
        seq_id=seq_id, request_id=str(seq_id), index=0, prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=100), arrival=seq_id,
    )


def test_a_long_prompt_prefills_in_a_pool_smaller_than_itself():
    # 40 tokens in chunks of 8 with a 4-token window: never more than 4 blocks of 4 at once
    bm = BlockManager(num_blocks=6, block_size=4, sliding_window=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4), bm)
    seq = _seq(1, 40)
    sched.add(seq)
    most = 0
    while seq.num_computed_tokens < 40:
        out = sched.schedule()
        assert [s.num_new_tokens for s in out.scheduled] == [8] and not out.preempted
        most = max(most, sum(b != bm.null_block for b in bm.block_tables[1]))
        sched.advance(out)
    assert most <= 4 and bm.num_window_releases == 7


def test_swapping_out_moves_only_the_live_blocks():
    bm = BlockManager(num_blocks=10, block_size=4, sliding_window=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, preemption_mode="swap"), bm, 8)
    seq = _seq(1, 24)
    sched.add(seq)
    sched.advance(sched.schedule())
    seq.output_token_ids.append(7)
    sched.schedule()  # the decode at 24 sees 21..24: blocks 0-4 (positions 0..19) are released
    live = [b for b in bm.block_tables[1] if b != bm.null_block]
    assert bm.block_tables[1][:5] == [bm.null_block] * 5 and len(live) == 2
    preempted = SchedulerOutput()
    sched._preempt(seq, preempted)
    assert [device for device, _ in preempted.swap_out] == live
    assert sched.host_tables[1][:5] == [None] * 5
    back = SchedulerOutput()
    sched._swap_in(back, 64)
    assert len(back.swap_in) == 2 and bm.block_tables[1][:5] == [bm.null_block] * 5
    sched.remove(seq)
    assert bm.num_free_blocks == bm.num_total_blocks
    assert sched.host_allocator is not None and sched.host_allocator.num_free_blocks == 8


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory, hf_tokenizer_dir):
    path = save_tiny("MistralForCausalLM", str(tmp_path_factory.mktemp("mistral-window")), hf_tokenizer_dir, sliding_window=8)
    return path, load_hf(path)


def test_sequences_longer_than_the_pool_match_hf(tiny_mistral):
    path, hf = tiny_mistral
    # 6 blocks of 8 tokens (and the null block) hold 48 tokens in all, yet each sequence reaches 64 tokens
    llm = LLM(
        model=path, device="cpu", dtype="float32", quantization="none", block_size=8, num_blocks_override=7,
        max_num_batched_tokens=8, enable_prefix_caching=True,
    )
    prompts = [list(range(5, 45)), list(range(300, 340))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(hf, prompt, 24) for prompt in prompts]
    for _ in range(2):  # the second round takes its in-window blocks from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [out.outputs[0].token_ids for out in outs] == expected
    assert llm.llm_engine.block_manager.num_window_releases > 0
    assert_all_blocks_free(llm)

"""Interleaved sliding-window and global layers: one block table per KV group, sliding groups free memory.

The layout and the hybrid block manager on their own, then tiny Gemma 2 and Gemma 3 checkpoints through
``LLM`` on pools too small for their sequences without the release, against HF transformers' greedy tokens.
"""

from __future__ import annotations

import pytest
from dense_model_utils import hf_greedy, load_hf, save_tiny

from engine import LLM, SamplingParams
from engine.hybrid_block_manager import HybridBlockManager
from engine.kv_groups import plan_kv_groups
from engine_test_utils import assert_all_blocks_free


def test_uniform_windows_need_no_groups():
    assert plan_kv_groups([None, None, None]) is None
    assert plan_kv_groups([4096] * 4) is None


def test_alternating_layers_make_two_groups_sharing_slots():
    layout = plan_kv_groups([8, None, 8, None])
    assert layout is not None and layout.slots == 2
    assert layout.windows == [None, 8]  # the global group first
    assert layout.groups[0].layers == (1, 3) and layout.groups[1].layers == (0, 2)
    assert layout.layer_slot == (0, 0, 1, 1) and layout.layer_group == (1, 0, 1, 0)
    caches = ["slot0", "slot1"]
    assert layout.layer_caches(caches) == ["slot0", "slot0", "slot1", "slot1"]
    with pytest.raises(ValueError, match="2 cache slots"):
        layout.layer_caches(["only one"])


def test_five_local_layers_per_global_one():
    # Gemma 3 1B: 26 layers, every sixth global
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    layout = plan_kv_groups(windows)
    assert layout is not None and layout.slots == 4
    assert layout.windows == [None] + [512] * 6  # 22 sliding layers in groups of at most 4
    assert sorted(layer for group in layout.groups for layer in group.layers) == list(range(26))
    assert all(len(group.layers) <= 4 for group in layout.groups)


def test_only_sliding_groups_release_blocks():
    bm = HybridBlockManager(num_blocks=20, block_size=4, windows=[None, 4])
    assert bm.num_total_blocks == 19
    bm.allocate(1, 16)  # four blocks in each group
    assert bm.num_free_blocks == 11
    assert bm.release_out_of_window(1, 16) == 3  # the sliding group keeps block 3 only
    glob, slide = bm.groups
    assert bm.null_block not in glob.block_tables[1]
    assert slide.block_tables[1][:3] == [bm.null_block] * 3
    bm.fork(1, 2)
    assert bm.copies_for_write(2, 15) and len(bm.copies_for_write(1, 15)) == 0  # 2 copied both, 1 owns them now
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_a_prefix_hit_must_hold_in_every_group():
    bm = HybridBlockManager(num_blocks=40, block_size=4, windows=[None, 4], enable_prefix_caching=True)
    tokens = list(range(50, 67))  # 17 tokens: four full blocks can be matched
    bm.allocate(1, 17)
    bm.register_computed(1, lambda a, b: tokens[a:b], 17)
    bm.free(1)
    assert bm.match_prefix(2, tokens) == 16
    glob, slide = bm.groups
    assert slide.block_tables[2][:3] == [bm.null_block] * 3 and bm.null_block not in glob.block_tables[2]
    # the groups cache their own blocks: the same tokens are two different blocks
    assert set(glob.block_tables[2]).isdisjoint(slide.block_tables[2][3:])
    bm.free(2)
    assert bm.num_free_blocks == bm.num_total_blocks


#: architecture -> (config overrides, KV groups the engine makes of its layers)
GEMMA = {
    # two layers, one sliding and one global: two groups of one layer
    "Gemma2ForCausalLM": (
        dict(sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0), 2
    ),
    # two sliding layers and a global one: three groups of one layer
    "Gemma3ForCausalLM": (
        dict(
            sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
        3,
    ),
}


@pytest.fixture(scope="module", params=list(GEMMA))
def tiny_gemma(request, tmp_path_factory, hf_tokenizer_dir):
    name = request.param
    path = save_tiny(name, str(tmp_path_factory.mktemp(name)), hf_tokenizer_dir, **GEMMA[name][0])
    hf = load_hf(path)
    prompts = [list(range(5, 45)), list(range(300, 337))]
    return name, path, prompts, [hf_greedy(hf, p, 24) for p in prompts]


def test_interleaved_windows_fit_a_pool_too_small_for_whole_tables(tiny_gemma):
    name, path, prompts, expected = tiny_gemma
    groups = GEMMA[name][1]
    # two sequences of 64 tokens: 8 blocks of 8 per group each without the release (16 x groups in all);
    # with it, the sliding groups hold at most 3 blocks per sequence
    needed = 2 * (8 + 3 * (groups - 1))
    assert needed < 16 * groups
    llm = LLM(
        model=path, device="cpu", dtype="float32", quantization="none", block_size=8, num_blocks_override=needed + 1,
        max_num_batched_tokens=16,
    )
    engine = llm.llm_engine
    assert isinstance(engine.block_manager, HybridBlockManager) and len(engine.block_manager.groups) == groups
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected, name
    assert engine.block_manager.num_window_releases > 0 and engine.scheduler.num_preemptions == 0
    assert_all_blocks_free(llm)


def test_chunked_prefill_and_prefix_cache_hits_in_every_group(tiny_gemma):
    name, path, prompts, expected = tiny_gemma
    llm = LLM(
        model=path, device="cpu", dtype="float32", quantization="none", block_size=8, kv_cache_memory_bytes=1 << 20,
        max_num_batched_tokens=16, enable_prefix_caching=True,
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # the second round starts from cached blocks in every group
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, name
    assert llm.llm_engine.block_manager.prefix_stats.hit_tokens == 32 + 32
    assert_all_blocks_free(llm)


def test_forks_and_recomputed_preemptions_keep_greedy_tokens(tiny_gemma):
    name, path, prompts, expected = tiny_gemma
    # room for about one sequence at a time: the other is preempted and recomputed
    llm = LLM(
        model=path, device="cpu", dtype="float32", quantization="none", block_size=8, num_blocks_override=18,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, tokens in zip(outs, expected):
        assert [c.token_ids for c in out.outputs] == [tokens, tokens], name
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_swapping_is_refused_for_interleaved_windows(tiny_gemma):
    _, path, _, _ = tiny_gemma
    with pytest.raises(ValueError, match="preemption_mode='swap' is not supported for models mixing"):
        LLM(model=path, device="cpu", dtype="float32", quantization="none", preemption_mode="swap", kv_cache_memory_bytes=1 << 20)

"""Prefix caching, sharing and copy-on-write: exact block ids in the block manager, identical outputs end to end."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams, block_manager
from engine.beam_search import BeamSearchParams
from engine.block_manager import BlockManager
from engine.errors import InvalidRequestError
from engine_test_utils import assert_all_blocks_free


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def fill(bm: BlockManager, seq_id: int, toks: list[int]) -> int:
    """Admit a sequence like the scheduler does: cached prefix first, then fresh blocks, then index."""
    cached = bm.match_prefix(seq_id, toks)
    bm.allocate(seq_id, len(toks))
    bm.register_computed(seq_id, lambda a, b: toks[a:b], len(toks))
    return cached


def test_second_sequence_reuses_full_blocks_only():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = tokens(10)
    assert fill(bm, 0, a) == 0
    assert bm.block_tables[0] == [0, 1, 2]
    b = a[:8] + [7, 7, 7]
    assert fill(bm, 1, b) == 8  # two full blocks shared, the rest is new
    assert bm.block_tables[1] == [0, 1, 3]
    assert [bm.allocator.ref_count(i) for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert bm.prefix_stats.hit_tokens == 8 and bm.prefix_stats.queried_tokens == 21


def test_a_whole_cached_prompt_still_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = tokens(8)
    fill(bm, 0, a)
    assert bm.match_prefix(1, a) == 4  # not 8: the last token must run to produce logits


def test_same_tokens_after_a_different_prefix_never_match():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    fill(bm, 0, tokens(4, 1) + tokens(4, 50) + [0])
    assert bm.match_prefix(1, tokens(4, 2) + tokens(4, 50) + [0]) == 0
    assert bm.match_prefix(2, tokens(4, 1) + tokens(4, 50) + [0]) == 8


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    fill(bm, 0, tokens(4, 10))  # blocks 0, 1 cached
    fill(bm, 1, tokens(4, 20))  # blocks 2, 3 cached
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 4  # cached but unreferenced blocks count as free
    assert bm.allocator.num_cached_blocks == 4
    # Reuse seq 0's prefix: its blocks are revived, not recomputed; its fifth token needs one more block,
    # and with no never-used block left the least recently used cached one goes: seq 1's last block (3),
    # since a sequence releases its last block first.
    assert fill(bm, 2, tokens(4, 10) + [1]) == 4
    assert bm.block_tables[2] == [0, 1, 3]
    fill(bm, 3, tokens(2, 90))
    assert bm.block_tables[3] == [2]
    assert bm.allocator.num_evictions == 2
    assert bm.match_prefix(4, tokens(4, 20) + [1]) == 0
    for s in (2, 3):
        bm.free(s)
    assert bm.num_free_blocks == 4


def test_fork_then_copy_on_write_of_the_shared_partial_block():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    bm.allocate(0, 6)  # blocks 0, 1; block 1 half full
    bm.fork(0, 1)
    assert bm.num_free_blocks == 4
    assert bm.copy_on_write(0, 8) is None  # position 8 starts a block of its own: nothing shared to copy
    assert bm.copy_on_write(0, 6) == (1, 2)  # seq 0 writes into shared block 1: it gets a private copy
    assert bm.block_tables == {0: [0, 2], 1: [0, 1]}
    assert bm.copy_on_write(1, 6) is None  # seq 1 is now block 1's only user
    assert bm.allocator.ref_count(0) == 2  # the full first block stays shared
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 6


@pytest.fixture(scope="module")
def llm_pair(tiny_llama_dir):
    on = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, block_size=16)
    off = LLM(
        model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, block_size=16,
        enable_prefix_caching=False,
    )
    return on, off


SYSTEM = "You are a helpful assistant that answers questions about geography, history and science. " * 3


def test_outputs_identical_with_prefix_caching_on_and_off(llm_pair):
    on, off = llm_pair
    prompts = [SYSTEM + q for q in ("Where is Peru?", "Who was Ada Lovelace?", "What is a quark?", "Name a river.")]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first = on.generate(prompts, params, use_tqdm=False)  # fills the cache
    second = on.generate(prompts, params, use_tqdm=False)  # hits it
    ref = off.generate(prompts, params, use_tqdm=False)
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    assert ids(first) == ids(second) == ids(ref)
    stats = on.llm_engine.block_manager.prefix_stats
    assert stats.hit_tokens > 0 and stats.hit_rate > 0.4
    assert off.llm_engine.block_manager.prefix_stats.hit_tokens == 0
    assert_all_blocks_free(on)
    assert_all_blocks_free(off)


def test_n4_shares_prompt_blocks_and_matches_separate_requests(llm_pair):
    _, off = llm_pair  # no prefix cache: any sharing comes from forking
    engine = off.llm_engine
    prompt = SYSTEM + "Tell me a story."
    n_params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request("shared", prompt, n_params)
    engine.step()  # prefill (fits one step) + first tokens, siblings forked
    used_shared = engine.num_total_blocks - engine.num_free_blocks
    engine.abort_request("shared")
    for i in range(4):
        engine.add_request(f"sep{i}", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i, ignore_eos=True))
    engine.step()
    used_separate = engine.num_total_blocks - engine.num_free_blocks
    engine.abort_request([f"sep{i}" for i in range(4)])
    assert used_shared < used_separate
    # Same seeds, same tokens: completion i of n=4 samples like a separate request seeded seed + i.
    together = off.generate(prompt, n_params, use_tqdm=False)[0]
    apart = off.generate(
        [prompt] * 4, [SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i, ignore_eos=True) for i in range(4)],
        use_tqdm=False,
    )
    assert [c.token_ids for c in together.outputs] == [o.outputs[0].token_ids for o in apart]
    assert_all_blocks_free(off)


# --- collision safety and cache salts ----------------------------------------------------------------


def fill_keyed(bm: BlockManager, seq_id: int, toks: list[int], key: object) -> int:
    cached = bm.match_prefix(seq_id, toks, key)
    bm.allocate(seq_id, len(toks))
    bm.register_computed(seq_id, lambda a, b: toks[a:b], len(toks), key)
    return cached


@pytest.fixture
def colliding_hash(monkeypatch):
    """Every block hashes to the same value: only the content check keeps blocks apart."""
    monkeypatch.setattr(block_manager, "content_hash", lambda content: b"\x00" * 32)


def test_a_hash_collision_never_shares_blocks_whose_tokens_differ(colliding_hash):
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = tokens(9, 100)
    assert fill(bm, 0, a) == 0
    # the first block indexed holds the one hash every block now has; a different first block must miss
    assert bm.match_prefix(1, tokens(9, 500)) == 0
    assert 1 not in bm.block_tables
    # the same first block hits; the second one collides with it but its content (parent, tokens) differs
    assert bm.match_prefix(2, a) == 4
    assert bm.block_tables[2] == [0]
    # same tokens as the indexed block, but at a later position (another parent): never shared
    repeated = a[:4] + a[:4] + [1]
    bm.free(2)
    assert bm.match_prefix(3, repeated) == 4
    assert bm.block_tables[3] == [0]


def test_different_salts_never_share_and_equal_salts_do():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = tokens(9)
    assert fill_keyed(bm, 0, a, "tenant-a") == 0
    assert bm.match_prefix(1, a, "tenant-b") == 0
    assert bm.match_prefix(2, a) == 0  # unsalted requests do not see salted blocks either
    assert bm.match_prefix(3, a, "tenant-a") == 8
    assert fill_keyed(bm, 4, a, None) == 0
    assert bm.match_prefix(5, a) == 8  # and unsalted ones share among themselves as before


def test_extra_keys_are_encoded_unambiguously():
    keys = [None, "", "1", b"1", 1, ("a", None), (None, "a"), ("a",), (("a",),), ("ab",), ("a", "b")]
    encoded = [block_manager.encode_extra_key(k) for k in keys]
    assert len(set(encoded)) == len(encoded)
    assert block_manager.encode_extra_key(("x", 3)) == block_manager.encode_extra_key(("x", 3))
    with pytest.raises(TypeError):
        block_manager.encode_extra_key(1.5)


def test_generation_stays_correct_under_forced_collisions(llm_pair, colliding_hash):
    on, off = llm_pair
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # different first blocks, all hashing alike: a lookup trusting the hash would hand each prompt the
    # first prompt's KV
    prompts = [SYSTEM + "Where is Peru?", "Completely different words open this prompt. " * 4, SYSTEM + "Name a river."]
    got = [on.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    want = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert_all_blocks_free(on)


def test_cache_salt_isolates_requests_end_to_end(llm_pair):
    on, off = llm_pair
    stats = on.llm_engine.block_manager.prefix_stats
    prompt = "A salted prompt that fills several KV blocks before the question starts. " * 3 + "Why?"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = off.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    runs = []
    for salt in ("alpha", "beta", None, "alpha"):
        before = stats.hit_tokens
        out = on.generate(prompt, params, use_tqdm=False, cache_salt=salt)[0].outputs[0].token_ids
        runs.append((out, stats.hit_tokens - before))
    assert [tokens for tokens, _ in runs] == [want] * 4
    assert [hits for _, hits in runs][:3] == [0, 0, 0]  # first alpha, first beta, first unsalted
    assert runs[3][1] > 0  # alpha again: its own blocks
    assert_all_blocks_free(on)


def test_salted_forks_and_beams_still_work(llm_pair):
    on, _ = llm_pair
    prompt = SYSTEM + "Tell me a story."
    n_params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    salted = on.generate(prompt, n_params, use_tqdm=False, cache_salt="forks")[0]
    plain = on.generate(prompt, n_params, use_tqdm=False)[0]
    assert [c.token_ids for c in salted.outputs] == [c.token_ids for c in plain.outputs]
    engine = on.llm_engine
    beam = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    engine.add_request("salted-beams", prompt, beam, cache_salt="beams")
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in on.beam_search(prompt, beam)[0].outputs]
    assert_all_blocks_free(on)


def test_an_empty_cache_salt_is_refused(llm_pair):
    on, _ = llm_pair
    with pytest.raises(InvalidRequestError, match="cache_salt") as info:
        on.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False, cache_salt="")
    assert info.value.param == "cache_salt"
    assert_all_blocks_free(on)

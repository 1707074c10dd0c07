"""Suffix decoding: the depth-limited suffix trie (counts, online updates, eviction), its proposals (the
match, the walk's stops, local against global), greedy outputs identical with and without it on a mixed
batch, the global trie helping a repeated request, no tries left behind by finished or aborted requests,
and one-line errors for a bad suffix config."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from dense_model_utils import PROMPTS

from engine import LLM, SamplingParams
from engine.speculative.config import parse_speculative_config
from engine.speculative.suffix import SuffixCache, SuffixTrie, propose_suffix
from engine_test_utils import assert_all_blocks_free

#: the speculation switch off: these tests count proposals, which its timing-driven choices would change
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "auto_disable": False}
REPETITIVE = [
    "one two three four five one two three four five one two three",
    "The cat sat on the mat. The cat sat on the mat. The cat",
]


def _paths(trie: SuffixTrie) -> Counter[tuple[int, ...]]:
    """Every node's path and count."""
    found: Counter[tuple[int, ...]] = Counter()
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            found[(*path, token)] = child.count
            stack.append(((*path, token), child))
    return found


def _substrings(sequences: list[list[int]], depth: int) -> Counter[tuple[int, ...]]:
    """What a trie of ``depth`` over ``sequences`` must count, by brute force."""
    counts: Counter[tuple[int, ...]] = Counter()
    for tokens in sequences:
        for start in range(len(tokens)):
            for length in range(1, depth + 1):
                if start + length <= len(tokens):
                    counts[tuple(tokens[start : start + length])] += 1
    return counts


def test_the_trie_counts_every_substring_up_to_its_depth():
    trie = SuffixTrie(3)
    trie.extend([1, 2, 1, 2, 3])
    assert trie.find([1, 2]).count == 2 and trie.find([2, 1, 2]).count == 1 and trie.find([1, 2, 3]).count == 1
    assert trie.find([1, 2, 1, 2]) is None and trie.find([3, 1]) is None
    assert [n.count for n in trie.active] == [1, 1, 1]  # [3], [2, 3], [1, 2, 3]
    assert _paths(trie) == _substrings([[1, 2, 1, 2, 3]], 3)


def test_online_updates_equal_a_build_from_scratch():
    rng = random.Random(0)
    tokens = [rng.randrange(4) for _ in range(300)]
    online, whole = SuffixTrie(6), SuffixTrie(6)
    fed = 0
    while fed < len(tokens):
        step = rng.randrange(0, 5)
        online.extend(tokens[fed : fed + step])
        fed += step
    whole.extend(tokens)
    assert online.num_tokens == len(tokens)
    assert _paths(online) == _paths(whole) == _substrings([tokens], 6)
    assert [id(n) for n in online.active] == [id(online.find(tokens[-n:])) for n in range(1, 7)]


def test_eviction_returns_counts_to_zero_and_removes_nodes():
    rng = random.Random(1)
    outputs = [[rng.randrange(5) for _ in range(40)] for _ in range(3)]
    cache = SuffixCache(max_depth=5, capacity=2)
    for tokens in outputs:
        cache.add(tokens)
    assert len(cache) == 2
    assert _paths(cache.trie) == _substrings(outputs[1:], 5)  # the oldest evicted
    for tokens in outputs[1:]:
        cache.trie.remove(tokens)
    assert cache.trie.root.children == {}
    assert len(SuffixCache(5, 0)) == 0


def test_the_proposal_follows_the_longest_continued_suffix():
    trie = SuffixTrie(8)
    tokens = [5, 6, 7, 8, 9, 5, 6]
    trie.extend(tokens)
    # [5, 6] matched (2 tokens): a factor of 1 proposes at most 2, a factor of 2 up to k
    assert propose_suffix(trie, None, tokens, 4, 1.0, 0.1) == [7, 8]
    assert propose_suffix(trie, None, tokens, 4, 2.0, 0.1) == [7, 8, 9, 5]
    assert propose_suffix(trie, None, tokens, 1, 2.0, 0.1) == [7]
    fresh = SuffixTrie(8)
    fresh.extend([1, 2, 3])
    assert propose_suffix(fresh, None, [1, 2, 3], 4, 1.0, 0.1) == []


def test_min_token_prob_and_max_spec_factor_stop_the_walk():
    tokens = [1, 2, 3, 5, 1, 2, 4, 6, 1, 2, 3, 8, 1, 2]
    trie = SuffixTrie(8)
    trie.extend(tokens)
    # after [1, 2]: 3 twice, 4 once (2/3); after [1, 2, 3]: 5 or 8 (1/2 each, the first seen wins)
    assert propose_suffix(trie, None, tokens, 4, 1.0, 0.1) == [3, 5]
    assert propose_suffix(trie, None, tokens, 4, 1.0, 0.6) == [3]
    assert propose_suffix(trie, None, tokens, 4, 1.0, 0.7) == []
    assert propose_suffix(trie, None, tokens, 4, 0.5, 0.1) == [3]
    assert propose_suffix(trie, None, tokens, 4, 0.0, 0.1) == []


def test_a_long_match_is_shortened_to_leave_the_walk_room():
    tokens = list(range(40)) + list(range(30))
    trie = SuffixTrie(16)
    trie.extend(tokens)
    # the whole 15-token match would leave one level below it; 8 tokens of match leave 8
    assert propose_suffix(trie, None, tokens[-15:], 8, 1.0, 0.1) == list(range(30, 38))


def test_the_likelier_of_the_local_and_global_proposals_wins():
    tokens = [1, 2, 3, 1, 2]
    local = SuffixTrie(8)
    local.extend(tokens)  # proposes [3, 1], expecting 2 accepted
    tie = SuffixTrie(8)
    tie.insert([1, 2, 7, 7, 7])  # [1, 2] matched: [7, 7], also 2
    assert propose_suffix(local, tie, tokens, 4, 1.0, 0.1) == [3, 1]
    longer = SuffixTrie(8)
    longer.insert([3, 1, 2, 7, 7, 7])  # [3, 1, 2] matched: [7, 7, 7], 3
    assert propose_suffix(local, longer, tokens, 4, 1.0, 0.1) == [7, 7, 7]


def test_suffix_config_defaults_and_one_line_errors(tiny_llama_dir):
    config = parse_speculative_config({"method": "suffix"})
    assert config is not None and config.num_speculative_tokens == 32
    assert (config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests) == (64, 256)
    assert (config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == (1.0, 0.1)
    for raw, message in (
        ({"method": "suffix", "prompt_lookup_max": 3}, "prompt_lookup_max is a setting of method 'ngram'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8}, "suffix_decoding_max_tree_depth"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor"),
        ({"method": "suffix", "suffix_decoding_lookahead": 2}, "suffix_decoding_lookahead"),
    ):
        with pytest.raises(ValueError, match=message) as caught:
            parse_speculative_config(raw)
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        LLM(model=tiny_llama_dir, device="cpu", speculative_config={"method": "suffix", "prompt_lookup_max": 3})


def _greedy(llm: LLM, prompts: list[str], max_tokens: int = 20) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_tokens_are_unchanged_and_a_repeated_batch_is_proposed_from_the_global_trie(tiny_llama_dir):
    """A random model never repeats itself: the first run proposes next to nothing; the second, identical,
    run proposes from the first run's outputs in the global trie and has them accepted. Then corrupted
    copies of the outputs evict those, and the third run's proposals are accepted up to a corruption and
    rejected there."""
    kwargs = dict(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    prompts = REPETITIVE + PROMPTS[:3]
    expected = _greedy(LLM(**kwargs), prompts)
    config = {**SUFFIX, "suffix_decoding_max_cached_requests": len(prompts)}
    spec = LLM(**kwargs, speculative_config=config, max_num_batched_tokens=16)
    speculator = spec.llm_engine.speculator
    assert _greedy(spec, prompts) == expected
    first = speculator.num_accepted
    assert speculator.tries == {} and len(speculator.cache) == len(prompts)
    assert _greedy(spec, prompts) == expected
    second = speculator.num_accepted - first
    assert second > max(first, 20) and speculator.num_accepted == speculator.num_proposed
    for tokens in expected:
        speculator.cache.add([(t + 1) % 1000 if i % 4 == 3 else t for i, t in enumerate(tokens)])
    proposed, accepted = speculator.num_proposed, speculator.num_accepted
    assert _greedy(spec, prompts) == expected
    assert 0 < speculator.num_accepted - accepted < speculator.num_proposed - proposed
    assert speculator.tries == {}
    assert_all_blocks_free(spec)


def test_finished_siblings_join_the_global_trie_and_aborted_requests_leave_nothing(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, speculative_config=SUFFIX)
    engine, speculator = llm.llm_engine, llm.llm_engine.speculator
    engine.add_request("long", REPETITIVE[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    siblings = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    engine.add_request("pair", REPETITIVE[1], siblings)
    while "pair" in engine.requests:
        engine.step()
    assert list(speculator.tries) == [engine.requests["long"].sequences[0].seq_id]
    assert len(speculator.cache) == 2
    engine.abort_request("long")
    assert speculator.tries == {} and len(speculator.cache) == 2
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)

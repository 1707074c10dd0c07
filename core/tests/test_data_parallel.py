"""Data parallelism: engine replicas in their own processes behind one engine; the prefix-aware router;
a dead replica stops the engine; the server answers through replicas and leaves no process behind."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from engine import LLM, RequestOutput, SamplingParams
from engine.errors import InvalidRequestError
from engine.parallel.mp_workers import WorkerFailed
from engine.parallel.prefix_router import PrefixAwareRouter, prompt_block_keys
from engine_test_utils import child_processes, engine_core_children, process_state

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3, 4,", "In a hole in the ground"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, **kwargs)


# --- the router ------------------------------------------------------------------------------------


def test_a_shared_prefix_goes_where_it_went_before_and_new_prompts_spread():
    router = PrefixAwareRouter([100, 100, 100], block_size=4)
    first = router.choose(list(range(1, 13)))
    others = {router.choose([50 + i, 51, 52, 53, 54]) for i in range(2)}
    assert first not in others and len(others) == 2  # no shared prefix: the least loaded, in turn
    # the first two blocks match the first prompt: its replica, though it is as loaded as the others
    assert router.choose([1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97, 96]) == first
    assert router.cached_blocks(first, prompt_block_keys(list(range(1, 13)), 4)) == 3


def test_salt_and_load_limit_the_prefix_preference():
    router = PrefixAwareRouter([100, 100], block_size=2, max_imbalance=2)
    prompt = [7, 8, 9, 10]
    home = router.choose(prompt)
    assert router.choose(prompt, cache_salt="tenant-b") != home  # another salt shares nothing
    router.finished(1 - home)
    picks = [router.choose(prompt) for _ in range(4)]
    # the home replica takes the prompt until it has 2 more requests in flight than the other
    assert picks[:2] == [home, home] and 1 - home in picks[2:]
    for _ in range(sum(router.load)):
        router.finished(home)
        router.finished(1 - home)
    assert router.load == [0, 0]


def test_a_replica_forgets_the_oldest_blocks_beyond_its_pool():
    router = PrefixAwareRouter([2], block_size=1)
    router.choose([1, 2, 3])  # three blocks sent to a pool of two: the first is forgotten
    assert router.cached_blocks(0, prompt_block_keys([1, 2, 3], 1)) == 0
    assert len(prompt_block_keys([1, 2, 3, 4, 5], 2, None)) == 2  # only full blocks have keys


# --- replicas ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir) -> list[RequestOutput]:
    """What a single-process engine gives for PROMPTS, for the engine's replicas and the server's to match
    (built once for both)."""
    one = _llm(tiny_llama_dir)
    try:
        return one.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        one.shutdown()


def test_two_replicas_give_one_process_tokens_share_the_work_and_fail_together(tiny_llama_dir, one_process):
    expected = [o.outputs[0].token_ids for o in one_process]
    dp = _llm(tiny_llama_dir, data_parallel_size=2)
    try:
        engine = dp.llm_engine
        assert len(engine.replicas) == 2 and {r.process.pid for r in engine.replicas} != {os.getpid()}
        outputs = dp.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert all(r.stats.get("prefix_cache_queried_tokens", 0) > 0 for r in engine.replicas)  # both worked
        # the same long prompt twice, one after the other: the second finds the first's blocks cached
        long_prompt = " ".join(PROMPTS * 4)
        before = engine.stats()["prefix_cache_hit_tokens"]
        dp.generate([long_prompt], GREEDY, use_tqdm=False)
        dp.generate([long_prompt], GREEDY, use_tqdm=False)
        assert engine.stats()["prefix_cache_hit_tokens"] - before >= 16
        assert engine.num_free_blocks == engine.num_total_blocks and not engine.has_unfinished_requests()
        with pytest.raises(InvalidRequestError, match="token id"):
            dp.generate([[10**9]], GREEDY, use_tqdm=False)  # refused by a replica, with its own message
        assert len(dp.generate(["Hello"], SamplingParams(max_tokens=3, n=2), use_tqdm=False)[0].outputs) == 2
        # a replica that dies stops the engine, with its reason
        victim = engine.replicas[1].process
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        with pytest.raises(WorkerFailed, match="replica 1 was killed by signal 9"):
            for _ in range(4):  # the dead one is chosen by the second request at the latest
                dp.generate(["The quick brown fox"], GREEDY, use_tqdm=False)
    finally:
        dp.shutdown()
    assert multiprocessing.active_children() == []


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads child processes from /proc")
def test_serve_with_two_replicas_answers_the_openai_client_and_leaves_no_child(tiny_llama_dir, one_process):
    import openai

    from engine.entrypoints.openai.launcher import ServerProcess

    expected = one_process
    server = ServerProcess([
        "--model", tiny_llama_dir, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "8MiB",
        "--data-parallel-size", "2",
    ]).start()  # fmt: skip
    try:
        assert server.proc is not None
        core, replicas = engine_core_children(server.proc.pid)
        assert len(replicas) == 2, child_processes(core)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        answer = client.completions.create(
            model=client.models.list().data[0].id, prompt=PROMPTS, max_tokens=GREEDY.max_tokens,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.text for c in sorted(answer.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in expected]
        assert server.stop(signal.SIGTERM, timeout_s=60) == 0
    finally:
        server.kill()
    assert not [pid for pid in [core, *replicas] if os.path.exists(f"/proc/{pid}") and process_state(pid) != "Z"]


def test_a_platform_of_one_device_refuses_a_second_rank_or_replica():
    from engine_plugin_sdk.reference_platform import ReferencePlatform

    platform = ReferencePlatform()
    platform.use_device(0)
    with pytest.raises(RuntimeError, match="drives one device per host; there is no device 1"):
        platform.use_device(1)

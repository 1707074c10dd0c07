"""The Ray executor: tensor-parallel ranks as Ray actors on a local Ray cluster give one process's tokens;
a rank whose actor dies stops the engine with its reason; shutting down leaves no actor and no Ray."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.parallel.mp_workers import WorkerFailed
from engine_test_utils import assert_all_blocks_free

ray = pytest.importorskip("ray", reason="the Ray executor needs ray (installed with the test extras)")

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3, 4,"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, **kwargs)


@pytest.mark.slow
def test_ray_ranks_give_one_process_tokens_and_a_dead_actor_stops_the_engine(tiny_qwen2_dir):
    expected = [o.outputs[0].token_ids for o in _llm(tiny_qwen2_dir).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = _llm(tiny_qwen2_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    workers = llm.llm_engine.workers
    try:
        assert type(workers).__name__ == "RayWorkers" and len(workers.actors) == 1 and ray.is_initialized()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        assert_all_blocks_free(llm)
        ray.kill(workers.actors[0])
        with pytest.raises(WorkerFailed, match=r"rank 1 \(a Ray actor\) is gone"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not ray.is_initialized()  # the executor started Ray, so it stopped it


def test_ray_with_data_parallel_replicas_of_several_ranks_is_refused_by_name(tiny_llama_dir):
    from engine.engine_setup import EngineConfigError

    with pytest.raises(EngineConfigError, match="data parallelism with replicas of several Ray-executed ranks"):
        _llm(tiny_llama_dir, tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="ray")

"""The Ray executor's configuration checks. Its engine (ranks as Ray actors on a local Ray cluster giving one
process's tokens, a dead actor stopping the engine with its reason, shutting down leaving no Ray) is checked by
test_parallel_decode_graphs.py::test_ray_ranks_replay_in_lockstep: each Ray engine costs a cluster start."""

from __future__ import annotations

import importlib.util

import pytest

from engine import LLM

# found, not imported: importing ray takes most of a second, which each test worker's collection would pay
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="the Ray executor needs ray (installed with the test extras)"
)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, **kwargs)


def test_ray_with_data_parallel_replicas_of_several_ranks_is_refused_by_name(tiny_llama_dir):
    from engine.engine_setup import EngineConfigError

    with pytest.raises(EngineConfigError, match="data parallelism with replicas of several Ray-executed ranks"):
        _llm(tiny_llama_dir, tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="ray")

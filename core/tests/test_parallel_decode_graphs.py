"""Decode graphs on every tensor-parallel rank, in lockstep: two gloo ranks on the test-only ``cpu-graphs``
platform (``lockstep_graph_plugin``) record the same buckets in the same order, replay the same bucket for
every decode step and give one process's tokens; a rank that cannot follow stops the engine with its
reason instead of leaving the driver waiting in a collective."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lockstep_graph_plugin import (
    DEVICE,
    FAULT_ENV,
    LOG_ENV,
    LockstepGraphsPlatform,
    read_log,
    write_entry_point,
)

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ParallelConfig
from engine.decode_graphs import DecodeGraphs
from engine.engine_setup import resolve_model
from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.graph_capture import EagerGraphCapture
from engine.parallel.mp_workers import WorkerFailed
from engine.parallel.rank_graphs import GraphPlan, LockstepError, check_plan, replay_bucket
from engine.plugins.manager import PluginManager
from engine_test_utils import assert_all_blocks_free

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3, 4,"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
#: buckets 1, 2, 4, 8: the three prompts decode together through bucket 4 (one padding row)
MAX_SEQS = 8
#: a hang would be a deadlock: the whole run is stopped with every thread's stack rather than wait forever
HANG_S = 120.0


def _llm(path: str, device: str = "cpu", **kwargs) -> LLM:
    return LLM(
        model=path,
        device=device,
        dtype="float32",
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=MAX_SEQS,
        **kwargs,
    )


@pytest.fixture
def graph_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The ``cpu-graphs`` plugin on this process's path (and so the workers'), logging to the returned file."""
    site = tmp_path / "site"
    write_entry_point(site)
    monkeypatch.syspath_prepend(str(site))
    log = tmp_path / "graphs.log"
    monkeypatch.setenv(LOG_ENV, str(log))
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        yield log
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert multiprocessing.active_children() == []


def test_two_ranks_replay_the_same_decode_graphs_and_give_one_process_tokens(tiny_llama_dir, graph_log):
    expected = [
        o.outputs[0].token_ids for o in _llm(tiny_llama_dir).generate(PROMPTS, GREEDY, use_tqdm=False)
    ]
    two = _llm(tiny_llama_dir, device=DEVICE, tensor_parallel_size=2)
    try:
        engine = two.llm_engine
        assert not engine.config.enforce_eager and engine.runner.decode_graphs is not None
        (worker,) = engine.workers.processes
        tokens = [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert tokens == expected
        assert_all_blocks_free(two)
    finally:
        two.shutdown()
    events = read_log(graph_log)
    assert sorted(events) == sorted([os.getpid(), worker.pid])
    driver, rank1 = events[os.getpid()], events[worker.pid]
    # the same buckets recorded in the same order, then the same replays: the 9 decode steps after each
    # prompt's first token, all three sequences in bucket 4
    assert [e for e in driver if e[0] == "capture"] == [("capture", b) for b in (8, 4, 2, 1)]
    assert driver == rank1
    assert [e for e in driver if e[0] == "replay"] == [("replay", 4)] * (GREEDY.max_tokens - 1)


#: what the worker does wrong, and the reason the driver reports
FAULTS = {
    # its platform cannot record collectives: refused before anyone records
    "no-claim": r"rank 1 runs eagerly .*graph_capture_collectives.*yet the driver records",
    # it fails between two buckets' collectives: the driver's next collective fails rather than waits
    "capture": r"rank 1 exited with status 1 \(rank 1: injected failure recording bucket 4\)",
    # it fails replaying a decode step: the step fails on the driver, and so does the engine
    "replay": r"rank 1 exited with status 1 \(rank 1: injected failure replaying bucket 4\)",
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_rank_that_cannot_follow_the_graphs_stops_the_engine_with_its_reason(
    fault, tiny_llama_dir, graph_log, monkeypatch
):
    monkeypatch.setenv(FAULT_ENV, f"{fault}:{os.getpid()}")
    start = time.monotonic()
    if fault != "replay":
        with pytest.raises(WorkerFailed, match=FAULTS[fault]):
            _llm(tiny_llama_dir, device=DEVICE, tensor_parallel_size=2)
    else:
        llm = _llm(tiny_llama_dir, device=DEVICE, tensor_parallel_size=2)
        try:
            with pytest.raises(WorkerFailed, match=FAULTS[fault]):
                llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        finally:
            llm.shutdown()
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_ray_ranks_replay_in_lockstep(tiny_llama_dir, graph_log, monkeypatch):
    """Ray actors replay the driver's decode graphs bucket for bucket, give one process's tokens and free every
    block; then a dead actor stops the engine with its reason, and shutting down stops the Ray the executor
    started. (A failed replay stopping the engine is checked with the multiprocessing ranks above; the Ray
    executor's other cases, in test_ray_executor: each Ray engine costs a cluster start, so this one engine
    checks all of that.)"""
    ray = pytest.importorskip("ray", reason="the Ray executor needs ray (installed with the test extras)")
    if ray.is_initialized():
        pytest.skip("Ray already runs in this process: its workers would not see the test plugin")
    # Ray's workers take their import path and settings from the environment Ray starts with
    path = [str(graph_log.parent / "site"), os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    expected = [
        o.outputs[0].token_ids for o in _llm(tiny_llama_dir).generate(PROMPTS, GREEDY, use_tqdm=False)
    ]
    llm = _llm(tiny_llama_dir, device=DEVICE, tensor_parallel_size=2, distributed_executor_backend="ray")
    workers = llm.llm_engine.workers
    try:
        assert type(workers).__name__ == "RayWorkers" and len(workers.actors) == 1 and ray.is_initialized()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        assert_all_blocks_free(llm)
        events = read_log(graph_log)
        driver = events.pop(os.getpid())
        (actor,) = events.values()  # rank 1's process
        assert actor == driver and driver.count(("replay", 4)) == GREEDY.max_tokens - 1
        ray.kill(workers.actors[0])
        with pytest.raises(WorkerFailed, match=r"rank 1 \(a Ray actor\) is gone"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not ray.is_initialized()  # the executor started Ray, so it stopped it


class RowsModel:
    """Stands in for a rank's model: each row's hidden state is its token id."""

    scale = 0.125

    def forward(self, input_ids: torch.Tensor, positions, kv_caches, metadata) -> torch.Tensor:
        return input_ids.float().unsqueeze(-1)


def _decode_metadata(seq_lens: list[int], query_lens: list[int] | None = None) -> AttentionMetadata:
    query_lens = query_lens or [1] * len(seq_lens)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = sum(query_lens)
    return AttentionMetadata(
        query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros((len(seq_lens), 2), dtype=torch.int32), slot_mapping=torch.arange(tokens),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_size=16, scale=0.125,
    )  # fmt: skip


def test_a_rank_refuses_another_plan_or_bucket_before_any_collective():
    graphs = DecodeGraphs(RowsModel(), [], EagerGraphCapture(), 8, 64, 16, torch.device("cpu"))
    graphs.capture()
    check_plan(graphs, GraphPlan((1, 2, 4, 8), 64), rank=1)
    with pytest.raises(
        LockstepError,
        match=r"rank 1 would record .*\[1, 2, 4, 8\] up to context 64, the driver for \[1, 2, 4, 8, 16\]",
    ):
        check_plan(graphs, GraphPlan((1, 2, 4, 8, 16), 64), rank=1)
    with pytest.raises(LockstepError, match="up to context 64, the driver for .* up to 128"):
        check_plan(graphs, GraphPlan((1, 2, 4, 8), 128), rank=1)

    ids, positions, metadata = torch.tensor([5, 6, 7]), torch.tensor([3, 4, 5]), _decode_metadata([4, 5, 6])
    assert replay_bucket(graphs, 4, ids, positions, metadata, rank=1).flatten().tolist() == [5.0, 6.0, 7.0]
    with pytest.raises(
        LockstepError, match="rank 1 would run the step through bucket 4, the driver replays bucket 8"
    ):
        replay_bucket(graphs, 8, ids, positions, metadata, rank=1)
    prefill = _decode_metadata([3, 1], query_lens=[3, 1])
    with pytest.raises(LockstepError, match="rank 2 would run the step eagerly, the driver replays bucket 4"):
        replay_bucket(graphs, 4, torch.arange(4), torch.arange(4), prefill, rank=2)
    with pytest.raises(LockstepError, match="rank 1 recorded no decode graphs"):
        replay_bucket(None, 4, ids, positions, metadata, rank=1)


def test_ranks_run_eagerly_unless_the_platform_records_collectives_and_no_pipeline_is_split(tiny_llama_dir):
    def eager(platform, **parallel) -> bool:
        config = EngineConfig(model=tiny_llama_dir, dtype="float32", parallel=ParallelConfig(**parallel))
        resolved = resolve_model(config, platform, PluginManager(load_entry_points=False))[0]
        assert not resolved.scheduler.async_scheduling  # the other ranks take their inputs from the host
        return resolved.enforce_eager

    from engine_plugin_cpu.platform import CpuPlatform

    assert not eager(LockstepGraphsPlatform(), tensor_parallel_size=2)
    assert eager(CpuPlatform(), tensor_parallel_size=2)
    assert eager(LockstepGraphsPlatform(), pipeline_parallel_size=2)
    assert eager(LockstepGraphsPlatform(), tensor_parallel_size=2, pipeline_parallel_size=2)

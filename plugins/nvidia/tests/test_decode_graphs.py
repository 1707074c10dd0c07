"""The core's padded decode-graph path (engine.decode_graphs) on this plugin's kernels.

On the CPU the graph capture is the eager fallback, which still runs the padded bucket inputs (slot -1,
context length 0 rows), so the padding logic is checked against the plain eager engine here; on a GPU
the same test replays real CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.decode_graphs import DecodeGraphs, decode_buckets
from engine.interfaces.graph_capture import EagerGraphCapture
from engine.llm_engine import LLMEngine
from engine.sampling.params import SamplingParams
from engine_conformance.test_end_to_end import build_tiny_llama, run_to_completion

PROMPTS = [[1, 5, 9, 33, 7], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 100], [1, 7, 8]]


def generate(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in run_to_completion(engine, PROMPTS, params)]


def test_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.slow
def test_padded_decode_graph_path_matches_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_NVIDIA_INTERPRET", "1")
    build_tiny_llama(tmp_path, head_dim=64)
    config = EngineConfig(
        model=str(tmp_path), device="cuda", dtype="float32", enforce_eager=True,
        cache=CacheConfig(block_size=16), scheduler=SchedulerConfig(max_num_seqs=6),
    )  # fmt: skip
    engine = LLMEngine.from_config(config)
    eager = generate(engine)
    graphs = DecodeGraphs(
        engine.model, engine.block_cache.kv_caches,
        engine.platform.make_graph_capture() if torch.cuda.is_available() else EagerGraphCapture(),
        6, engine.max_model_len, 16, engine.device,
    )  # fmt: skip
    graphs.capture()
    engine.runner.decode_graphs = graphs
    calls: list[int] = []
    original_run = graphs.graphs.run

    def counting_run(batch_size: int, *inputs: object) -> object:
        calls.append(batch_size)
        return original_run(batch_size, *inputs)

    graphs.graphs.run = counting_run  # type: ignore[method-assign]
    assert generate(engine) == eager
    assert calls and set(calls) <= set(graphs.buckets), f"decode steps should pad to a bucket, got {calls}"

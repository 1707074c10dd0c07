"""The CPU's compiled decode path: the opaque paged-decode op on padded buckets, and the whole engine
with ``ENGINE_CPU_COMPILE=1`` against the eager engine on a tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine_plugin_cpu.attention import CpuAttentionBackend
from engine_plugin_cpu.graph_capture import CompiledGraphCapture
from engine_plugin_cpu.platform import COMPILE_ENV, CpuPlatform, compile_enabled
from engine_plugin_sdk import AttentionMetadata
from engine_plugin_sdk.testing import build_tiny_llama, run_to_completion

BLOCK = 16
KV_HEADS, HEADS, DIM = 2, 4, 32


def padded_decode_inputs(
    lens: list[int], bucket: int, width: int, num_blocks: int
) -> dict[str, torch.Tensor]:
    """A decode step of ``len(lens)`` sequences padded to ``bucket`` rows the way the core pads it."""
    n = len(lens)
    perm = torch.randperm(num_blocks)
    tables = torch.zeros((bucket, width), dtype=torch.int32)
    slots = torch.full((bucket,), -1, dtype=torch.int64)
    used = 0
    for i, length in enumerate(lens):
        blocks = -(-length // BLOCK)
        tables[i, :blocks] = perm[used : used + blocks].to(torch.int32)
        used += blocks
        slots[i] = int(tables[i, (length - 1) // BLOCK]) * BLOCK + (length - 1) % BLOCK
    seq_lens = torch.zeros(bucket, dtype=torch.int32)
    seq_lens[:n] = torch.tensor(lens, dtype=torch.int32)
    return {"slot_mapping": slots, "seq_lens": seq_lens, "block_tables": tables}


def metadata_for(inputs: dict[str, torch.Tensor], rows: int, bucket_mode: bool) -> AttentionMetadata:
    lens = inputs["seq_lens"][:rows].tolist()
    cut = slice(None) if bucket_mode else slice(0, rows)
    return AttentionMetadata(
        query_start_loc=torch.arange(
            (len(inputs["seq_lens"]) if bucket_mode else rows) + 1, dtype=torch.int32
        ),
        seq_lens=inputs["seq_lens"][cut],
        block_tables=inputs["block_tables"][cut],
        slot_mapping=inputs["slot_mapping"][cut],
        query_lens_cpu=[1] * rows,
        seq_lens_cpu=lens,
        max_query_len=1,
        max_seq_len=max(lens),
        block_size=BLOCK,
        scale=DIM**-0.5,
        graph_capture=bucket_mode,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_bucket_op_matches_eager_and_rebuilds_on_new_inputs(dtype: torch.dtype) -> None:
    bucket, width = 8, 12
    num_blocks = bucket * width  # room for every row's table at its widest
    backend = CpuAttentionBackend()
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM).to(dtype)
    for step in range(3):  # new lengths and tables every step: the op must not reuse a stale plan
        lens = torch.randint(1, width * BLOCK, (int(torch.randint(1, bucket + 1, ())),)).tolist()
        inputs = padded_decode_inputs(lens, bucket, width, num_blocks)
        q, k, v = (torch.randn(bucket, h, DIM).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
        ref_cache = cache.clone()
        n = len(lens)
        expected = CpuAttentionBackend().forward(
            q[:n], k[:n], v[:n], ref_cache, metadata_for(inputs, n, False)
        )
        padded = metadata_for(inputs, n, True)
        for _layer in range(2):  # the second call reuses the step built by the first
            got = backend.forward(q, k, v, cache, padded)
        torch.testing.assert_close(got[:n], expected, rtol=0, atol=0, msg=f"step {step}")
        assert torch.count_nonzero(got[n:]) == 0, "padding rows must come back as zeros"
        assert torch.equal(cache, ref_cache), "the op must write exactly the real rows' keys and values"


def test_compile_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert not compile_enabled() and not CpuPlatform().capabilities().graph_capture
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert CpuPlatform().capabilities().graph_capture
    assert CpuPlatform().capabilities().graph_capture_collectives  # tensor-parallel ranks compile too
    assert isinstance(CpuPlatform().make_graph_capture(), CompiledGraphCapture)
    # torch.compile cannot trace oneDNN-prepacked weights
    assert not CpuPlatform().make_gemm_backend().prepack


def generate(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in run_to_completion(engine, prompts, params)]


@pytest.mark.slow
def test_compiled_engine_matches_eager_and_frees_every_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(COMPILE_ENV, "1")
    build_tiny_llama(tmp_path, head_dim=32, seed=int(torch.randint(0, 1000, ())), num_layers=1)  # compile time: a layer
    prompts = [torch.randint(3, 128, (int(n),)).tolist() for n in torch.randint(2, 40, (5,))]

    def engine(eager: bool) -> Any:
        llm = LLM(
            model=str(tmp_path), device="cpu", dtype="float32", enforce_eager=eager,
            block_size=BLOCK, max_num_seqs=2,
        )  # fmt: skip
        return llm.llm_engine

    # the plugin's own capture objects, recorded as the platform hands them to the engine
    captures: list[CompiledGraphCapture] = []
    calls: list[int] = []
    make_capture = CpuPlatform.make_graph_capture
    run = CompiledGraphCapture.run

    def recording_make(self: CpuPlatform) -> Any:
        capture = make_capture(self)
        captures.append(capture)
        return capture

    def counting_run(self: CompiledGraphCapture, batch_size: int, *inputs: object) -> object:
        calls.append(batch_size)
        return run(self, batch_size, *inputs)

    monkeypatch.setattr(CpuPlatform, "make_graph_capture", recording_make)
    monkeypatch.setattr(CompiledGraphCapture, "run", counting_run)

    eager = generate(engine(True), prompts, 12)
    compiled = engine(False)
    captured = [c for c in captures if isinstance(c, CompiledGraphCapture) and c.captured_batch_sizes()]
    # two buckets keep the compile time down (each bucket compiles on its own, tens of seconds cold)
    assert len(captured) == 1 and captured[0].captured_batch_sizes() == [1, 2]
    calls.clear()
    # five prompts on two sequence slots: decode batches of 2, then 1, each after different inputs
    assert generate(compiled, prompts, 12) == eager
    assert {1, 2} <= set(calls), (
        f"decode steps should have replayed buckets 1 and 2, got {sorted(set(calls))}"
    )
    assert not compiled.has_unfinished_requests()
    assert compiled.num_free_blocks == compiled.num_total_blocks


@pytest.mark.slow
def test_compiled_decode_steps_run_on_two_ranks_in_lockstep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two gloo ranks each compile the decode bucket with the all-reduces inside, and give the eager
    single process's tokens (the core's test_parallel_decode_graphs checks the lockstep rank by rank). One
    sequence at a time: one bucket a rank to compile (the padded buckets are the single-process test's)."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    build_tiny_llama(tmp_path, head_dim=32, seed=3, num_layers=1)
    prompts = [torch.randint(3, 128, (int(n),)).tolist() for n in (5, 17)]

    def llm(**kwargs: Any) -> Any:
        return LLM(
            model=str(tmp_path), device="cpu", dtype="float32", block_size=BLOCK, max_num_seqs=1, **kwargs
        )

    eager = generate(llm(enforce_eager=True).llm_engine, prompts, 8)
    two = llm(tensor_parallel_size=2)
    try:
        engine = two.llm_engine
        assert not engine.config.enforce_eager
        assert engine.runner.decode_graphs.graphs.captured_batch_sizes() == [1]
        assert generate(engine, prompts, 8) == eager
        assert engine.num_free_blocks == engine.num_total_blocks
    finally:
        two.shutdown()

"""The start-up warm-up (engine.warm_up): which dummy steps run, and that they leave no trace."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import engine.start_up_graphs as start_up_module
from engine import LLM, SamplingParams
from engine.warm_up import WarmUpBatch, warm_up_batches
from engine_plugin_cpu.platform import CpuPlatform
from engine_test_utils import assert_all_blocks_free


def test_batches_fill_the_step_budget() -> None:
    # each power of two, one more, and (from 32) 16 more
    doubling = [m for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) for m in (n, n + 1, n + 16) if m < 2 * n]
    assert warm_up_batches(4096, 256, 2048, 16, eager_decode=False) == [
        WarmUpBatch("prefill", [2048, 2048], [2048, 2048]),
    ] + [WarmUpBatch(f"prefill-{n}", [n], [n]) for n in doubling + [2048]] + [
        WarmUpBatch("prefill-2049", [2048, 1], [2048, 1]),
        WarmUpBatch("prefill-2064", [2048, 16], [2048, 16]),
        WarmUpBatch("mixed", [1] * 255 + [2048], [64] * 255 + [2048]),
    ] + [WarmUpBatch(f"mixed-{n}", [1] * n + [2048], [64] * n + [2048]) for n in (1, 2, 4, 8, 16, 32, 64, 128)]
    # a budget that is not a whole number of prompts ends with a shorter one; the prompt steps past the
    # longest prompt are several
    batches = warm_up_batches(300, 8, 128, 16, eager_decode=False)
    assert batches[0] == WarmUpBatch("prefill", [128, 128, 44], [128, 128, 44])
    assert [b.name for b in batches[1:7]] == ["prefill-2", "prefill-3", "prefill-4", "prefill-5", "prefill-8", "prefill-9"]
    assert [b.name for b in batches[11:15]] == ["prefill-48", "prefill-64", "prefill-65", "prefill-80"]
    assert batches[15:21] == [
        WarmUpBatch("prefill-128", [128], [128]), WarmUpBatch("prefill-129", [128, 1], [128, 1]),
        WarmUpBatch("prefill-144", [128, 16], [128, 16]), WarmUpBatch("prefill-256", [128, 128], [128, 128]),
        WarmUpBatch("prefill-257", [128, 128, 1], [128, 128, 1]),
        WarmUpBatch("prefill-272", [128, 128, 16], [128, 128, 16]),
    ]  # fmt: skip
    assert batches[21] == WarmUpBatch("mixed", [1] * 7 + [128], [64] * 7 + [128])
    assert [b.name for b in batches[22:]] == ["mixed-1", "mixed-2", "mixed-4"]


def test_eager_decode_contexts_double_up_to_the_longest() -> None:
    batches = warm_up_batches(64, 1, 100, 16, eager_decode=True)
    # one sequence at a time: no mixed step is possible
    assert [b.name for b in batches] == [
        "prefill", "prefill-2", "prefill-3", "prefill-4", "prefill-5", "prefill-8", "prefill-9", "prefill-16",
        "prefill-17", "prefill-32", "prefill-33", "prefill-48", "decode@16", "decode@32", "decode@64", "decode@100",
    ]  # fmt: skip
    assert batches[0] == WarmUpBatch("prefill", [64], [64])
    assert batches[-1] == WarmUpBatch("decode@100", [1], [100])


def assert_every_class_in_both_forms(counts: set[int], edges: list[int], reachable: set[int]) -> None:
    """Each class ``(edges[i], edges[i + 1]]`` holds a warmed count that is a multiple of 16 and one that is not,
    of each kind some reachable count in it has."""
    for low, high in zip(edges, edges[1:], strict=False):
        for multiple in (True, False):
            if any(low < n <= high and (n % 16 == 0) == multiple for n in reachable):
                assert any(low < n <= high and (n % 16 == 0) == multiple for n in counts), (low, high, multiple)


@pytest.mark.parametrize(("budget", "top_k"), [(2048, 8), (8192, 8), (2048, 4), (512, 2), (4096, 1), (1000, 6)])
def test_prompt_steps_reach_every_moe_tile_class_in_both_integer_forms(budget: int, top_k: int) -> None:
    # the GPUs' MoE kernels pick tiles by the step's token-expert pairs, and Triton compiles their integers apart
    # when they are multiples of 16: every tile class that serving can reach must have run at start-up with a
    # pair count of each kind it can hold
    from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import H200_MOE_TILES as tiles

    warmed = {sum(b.query_lens) * top_k for b in warm_up_batches(budget, 256, 4096, 16, eager_decode=False)}
    edges = [tiles.gemv_max_slots, *(max_slots for max_slots, *_ in tiles.gemm[:-1]), budget * top_k]
    assert_every_class_in_both_forms(warmed, edges, {n * top_k for n in range(1, budget + 1)})


@pytest.mark.parametrize("budget", [2048, 8192, 100, 300])
def test_prompt_steps_reach_every_packed_gemm_class_in_both_integer_forms(budget: int) -> None:
    # likewise the GPUs' grouped-integer GEMM (packed 4- and 8-bit weights), tiles by the product's rows, between
    # the tensor-core kernel's few rows and the dense copy's many
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import H200_GROUPED_INT_TILES as tiles

    warmed = {sum(b.query_lens) for b in warm_up_batches(budget, 256, 4096, 16, eager_decode=False)}
    gemm = [rows for rows, *_ in tiles.gemm[:-1] if tiles.mma_rows < rows < tiles.dense_rows]
    edges = [tiles.mma_rows, *gemm, tiles.dense_rows - 1]
    assert_every_class_in_both_forms(warmed, edges, set(range(1, budget + 1)))


@pytest.fixture
def warm_cpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int | str, int]]:
    """The CPU platform claiming warm-up; records each warm-up forward's (rows, longest query) and each
    greedy pick's ("greedy", rows)."""
    claims = CpuPlatform.capabilities
    monkeypatch.setattr(CpuPlatform, "capabilities", lambda self: dataclasses.replace(claims(self), warm_up=True))
    calls: list[tuple[int | str, int]] = []
    real = start_up_module.run_warm_up

    def spy(model, kv_caches, batches, *args, **kwargs):
        greedy = kwargs.get("greedy")
        if greedy is not None:

            def picked(logits):
                calls.append(("greedy", logits.shape[0]))
                return greedy(logits)

            kwargs["greedy"] = picked

        before = [kv.clone() for kv in kv_caches]
        forward = model.forward

        def counted(input_ids, positions, caches, metadata):
            calls.append((input_ids.shape[0], metadata.max_query_len))
            return forward(input_ids, positions, caches, metadata)

        model.forward = counted
        try:
            seconds = real(model, kv_caches, batches, *args, **kwargs)
        finally:
            del model.forward
        # every slot was negative: the cache is bit for bit what it was
        for old, new in zip(before, kv_caches, strict=True):
            assert torch.equal(old.view(torch.uint8), new.view(torch.uint8))
        return seconds

    monkeypatch.setattr(start_up_module, "run_warm_up", spy)
    return calls


def test_engine_warms_up_when_the_platform_asks(tiny_llama_dir, warm_cpu, caplog, monkeypatch) -> None:
    prompts = [[1, 5, 9, 33, 7, 40], [1, 60, 61, 62], [1, 100, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    options = {"model": tiny_llama_dir, "device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": 8 << 20}
    with caplog.at_level(logging.INFO, logger="engine.warm_up"):
        warm = LLM(**options, max_model_len=64, max_num_batched_tokens=96, max_num_seqs=4, enforce_eager=True)
    # prefill: one whole 64-token prompt and a 32-token one, then one prompt of 2, 3, 4, 5 ... 48, 64 tokens
    # and two of 64 + 1 and 64 + 16; mixed: 3 decodes and a 64-token chunk, then one and two decodes beside the
    # chunk; then eager decodes at contexts 16, 32 and 64, and 4 at once; each step's last rows through the
    # sampler's greedy pick
    short_steps = [step for n in (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 48, 64) for step in ((n, n), ("greedy", 1))]
    assert warm_cpu == [(96, 64), ("greedy", 2), *short_steps, (65, 64), ("greedy", 2), (80, 64), ("greedy", 2),
                        (67, 64), ("greedy", 4), (65, 64), ("greedy", 2), (66, 64), ("greedy", 3), (1, 1), ("greedy", 1),
                        (1, 1), ("greedy", 1), (1, 1), ("greedy", 1), (4, 1), ("greedy", 4)]  # fmt: skip
    assert any("warm-up: 22 dummy steps" in r.getMessage() for r in caplog.records)
    assert_all_blocks_free(warm)
    got = [list(o.outputs[0].token_ids) for o in warm.generate(prompts, params, use_tqdm=False)]
    assert_all_blocks_free(warm)
    del warm
    warm_cpu.clear()
    monkeypatch.undo()  # the same engine without the warm-up
    cold = LLM(**options, max_model_len=64, max_num_batched_tokens=96, max_num_seqs=4, enforce_eager=True)
    want = [list(o.outputs[0].token_ids) for o in cold.generate(prompts, params, use_tqdm=False)]
    assert warm_cpu == []
    assert got == want


def test_a_step_that_does_not_fit_is_refused_at_start_up(tiny_llama_dir, warm_cpu, monkeypatch) -> None:
    from engine.llm_engine import EngineConfigError

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(start_up_module, "run_warm_up", out_of_memory)
    with pytest.raises(EngineConfigError, match="a step of 96 tokens does not fit .* lower --max-num-batched-tokens"):
        LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=96)


def test_platforms_that_do_not_ask_skip_it(tiny_llama_dir, monkeypatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(start_up_module, "run_warm_up", lambda *a, **kw: calls.append(a))
    LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert calls == []


def test_pooling_models_warm_up_without_an_lm_head(tmp_path, warm_cpu) -> None:
    """An encoder on a platform that warms up (every GPU): the dummy steps read its hidden rows, not
    logits it cannot compute, and its embeddings come out the same as without the warm-up."""
    from test_encoders import save_encoder

    path = save_encoder("bert", str(tmp_path / "bert"))
    texts = ["the quick brown fox", "paris is the capital of france"]
    options = {"model": path, "device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": 16 << 20}
    warm = LLM(**options, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4, enforce_eager=True)
    # whole prompts only: one step of one 64-token prompt and shorter ones, no mixed step and no decodes
    assert warm_cpu == [(64, 64), *((n, n) for n in (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 48))]
    got = torch.stack([torch.tensor(o.outputs.embedding) for o in warm.embed(texts, use_tqdm=False)])
    assert_all_blocks_free(warm)
    del warm
    cold = LLM(**options, max_model_len=64)
    expected = torch.stack([torch.tensor(o.outputs.embedding) for o in cold.embed(texts, use_tqdm=False)])
    torch.testing.assert_close(got, expected)


def test_warm_up_through_adapter_slots_leaves_no_trace(tiny_llama_dir, tiny_llama_loras, warm_cpu, monkeypatch) -> None:
    from engine.lora import LoRARequest

    # every warm-up row reads slot 0 (the lm_head's and embeddings' parts too): afterwards the adapters'
    # requests and the plain ones must be what an engine without the warm-up gives
    options = {"model": tiny_llama_dir, "device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": 8 << 20,
               "enable_lora": True, "max_loras": 2, "max_lora_rank": 16, "max_model_len": 64,
               "max_num_batched_tokens": 96, "max_num_seqs": 4, "enforce_eager": True}  # fmt: skip
    prompts = [[1, 5, 9, 33, 7], [1, 60, 61, 62], [1, 100, 3]]
    loras = [LoRARequest("head", 1, tiny_llama_loras["embed-head"]), None, LoRARequest("all", 2, tiny_llama_loras["all-r16-rslora"])]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    warm = LLM(**options)
    assert warm_cpu and warm.llm_engine.model.lora_slots.head_slots == set()
    got = [list(o.outputs[0].token_ids) for o in warm.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    assert_all_blocks_free(warm)
    del warm
    monkeypatch.undo()
    cold = LLM(**options)
    want = [list(o.outputs[0].token_ids) for o in cold.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    assert got == want

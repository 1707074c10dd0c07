"""Tensor and pipeline parallelism on the CPU: two gloo ranks in their own processes give one process's
tokens and logits; bad splits are refused, a dead rank stops the server, no process is left behind."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from dense_model_utils import TINY, engine_prefill_logits, save_tiny
from gguf_test_models import write_tiny_llama_gguf

from engine import LLM, SamplingParams, engine_setup
from engine.engine_setup import EngineConfigError
from engine.loader import lazy_tensor
from engine_test_utils import assert_all_blocks_free, engine_core_children, process_state

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3, 4,"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, **kwargs)


def record_window_reads(monkeypatch: pytest.MonkeyPatch) -> list[lazy_tensor.LazyTensor]:
    """The checkpoint windows this process reads from now on (rank 0's, for a parallel engine)."""
    reads: list[lazy_tensor.LazyTensor] = []
    read_window = lazy_tensor.read_window
    monkeypatch.setattr(lazy_tensor, "read_window", lambda t: reads.append(t) or read_window(t))
    return reads


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@dataclass
class OneProcess:
    """What a single-process engine gives for PROMPTS (greedy tokens, prefill logits), for a parallel
    engine of the same model to match."""

    tokens: list[list[int]]
    prompt_ids: list[list[int]]
    logits: torch.Tensor

    @classmethod
    def of(cls, llm: LLM) -> OneProcess:
        prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        return cls(_tokens(llm), prompt_ids, engine_prefill_logits(llm, prompt_ids))

    def assert_matched_by(self, parallel: LLM) -> None:
        """The same tokens, logits within 1e-4, and every KV block back in the pool."""
        assert _tokens(parallel) == self.tokens
        torch.testing.assert_close(engine_prefill_logits(parallel, self.prompt_ids), self.logits, atol=1e-4, rtol=1e-4)
        assert_all_blocks_free(parallel)


class Checkpoints:
    """Tiny checkpoints, their single-process references and engines, made once for the module: the
    parametrized cases of one model (and the tests that share a model) compare against the same reference
    instead of saving the model and building its single-process engine again. Only the engine used last is
    kept (the references stay); the engines cache no prefix blocks, so every prompt they run is computed
    from scratch, as in a fresh engine."""

    def __init__(self, root: Path, tokenizer_dir: str) -> None:
        self.root = root
        self.tokenizer_dir = tokenizer_dir
        self.paths: dict[str, str] = {}
        self.references: dict[str, OneProcess] = {}
        self.last: tuple[str, LLM] | None = None

    def save(self, architecture: str, **overrides) -> str:
        """``save_tiny(architecture, **overrides)``, saved once (overrides equal to the defaults make the
        same checkpoint)."""
        key = repr((architecture, sorted((k, v) for k, v in overrides.items() if TINY.get(k, object()) != v)))
        if key not in self.paths:
            self.paths[key] = save_tiny(architecture, str(self.root / f"ckpt{len(self.paths)}"), self.tokenizer_dir, **overrides)
        return self.paths[key]

    def engine(self, path: str) -> LLM:
        """The single-process engine of ``path``."""
        if self.last is None or self.last[0] != path:
            self.close()
            self.last = (path, _llm(path, enable_prefix_caching=False))
        return self.last[1]

    def reference(self, path: str) -> OneProcess:
        """What the single-process engine of ``path`` gives for PROMPTS."""
        if path not in self.references:
            self.references[path] = OneProcess.of(self.engine(path))
        return self.references[path]

    def close(self) -> None:
        if self.last is not None:
            self.last[1].shutdown()
            self.last = None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, hf_tokenizer_dir):
    made = Checkpoints(tmp_path_factory.mktemp("parallelism"), hf_tokenizer_dir)
    yield made
    made.close()


@pytest.mark.parametrize(
    "architecture, overrides",
    [
        ("LlamaForCausalLM", {}),  # 4 query heads over 2 KV heads: one KV head per rank
        ("Qwen2ForCausalLM", {"num_key_value_heads": 1}),  # q/k/v biases; the one KV head on both ranks
    ],
)
def test_two_ranks_give_one_process_tokens_and_logits(architecture, overrides, checkpoints, monkeypatch):
    path = checkpoints.save(architecture, **overrides)
    one, reference = checkpoints.engine(path), checkpoints.reference(path)
    reads = record_window_reads(monkeypatch)
    two = _llm(path, tensor_parallel_size=2)
    try:
        # rank 0 (this process) read only its slices of the projections and of the lm_head
        projections = [t for t in reads if t.name.endswith("proj.weight")]
        assert len(projections) == 2 * 7 and all(t.shape != t.full_shape or t.name.endswith(("k_proj.weight", "v_proj.weight")) for t in projections)
        if architecture == "LlamaForCausalLM":  # one KV head a rank: exactly half of every projection
            assert 2 * sum(math.prod(t.shape) for t in projections) == sum(math.prod(t.full_shape) for t in projections)
        (head,) = [t for t in reads if t.name == "lm_head.weight"]
        (embed,) = [t for t in reads if t.name == "model.embed_tokens.weight"]
        assert head.shape[0] == head.full_shape[0] // 2 and embed.shape[0] == embed.full_shape[0] // 2
        assert two.llm_engine.model.embed_tokens.shape[0] == one.llm_engine.model.embed_tokens.shape[0] // 2
        assert len(two.llm_engine.workers.processes) == 1
        assert two.llm_engine.model.num_heads == one.llm_engine.model.num_heads // 2
        reference.assert_matched_by(two)
    finally:
        two.shutdown()
    assert not any(p.is_alive() for p in two.llm_engine.workers.processes)
    assert multiprocessing.active_children() == []


def test_two_ranks_keep_a_gguf_model_quantized_and_give_one_process_tokens(smollm_gguf_path, tmp_path, monkeypatch):
    # Q8_0 matrices (blocks of 32): every rank's rows, and its half of the o_proj and down columns, fall on
    # whole blocks, so the slices stay quantized
    path = tmp_path / "tiny-q8_0.gguf"
    write_tiny_llama_gguf(path, scheme="gguf_q8_0", head_scheme="gguf_q8_0")
    prompts = [[5, 17, 300, 42, 7], [100, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [511, 0, 256]]

    def run(**kwargs) -> tuple[LLM, list[list[int]], list[float]]:
        llm = LLM(model=str(path), tokenizer=smollm_gguf_path, device="cpu", dtype="float32",
                  kv_cache_memory_bytes=16 << 20, **kwargs)  # fmt: skip
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outs], [o.outputs[0].cumulative_logprob for o in outs]

    _, expected, expected_logprobs = run()
    from engine_plugin_cpu.gemm import CpuGemmBackend

    prepared: list[tuple[str, tuple[int, int]]] = []
    prepare = CpuGemmBackend.prepare_weight

    def recording(self, weight, dtype):
        prepared.append((getattr(weight, "scheme", "dense"), tuple(weight.shape)))
        return prepare(self, weight, dtype)

    monkeypatch.setattr(CpuGemmBackend, "prepare_weight", recording)
    two, tokens, logprobs = run(tensor_parallel_size=2)
    try:
        assert tokens == expected and logprobs == pytest.approx(expected_logprobs, abs=1e-3)
        # rank 0 (this process) got its slices still in Q8_0: per layer q/k/v rows, the o_proj's and the
        # down projection's half of the columns, gate/up rows; and half of the lm_head's rows
        # (head size 64): o_proj 2 of 4 heads' columns; q/k/v 2 query heads and 1 KV head's rows; down half
        # of 512 columns; gate/up half of each one's 512 rows; the lm_head half of 512 vocabulary rows
        assert sorted(prepared) == sorted(
            [("gguf_q8_0", (256, 128))] * 2 + [("gguf_q8_0", (128 + 64 + 64, 256))] * 2
            + [("gguf_q8_0", (256, 256))] * 2 + [("gguf_q8_0", (512, 256))] * 2 + [("gguf_q8_0", (256, 256))]
        ), prepared
    finally:
        two.shutdown()
    assert multiprocessing.active_children() == []


# one layer a stage, each step in two micro-batches (the default: one per stage); stages of 2 and 1 layers
# taking turns on whole steps
@pytest.mark.parametrize("layers, micro_batches", [(2, None), (3, 1)])
def test_two_pipeline_stages_give_one_process_tokens_and_logits(layers, micro_batches, checkpoints, monkeypatch):
    # (2 layers: the tensor-parallel Llama case's checkpoint, and its single-process reference)
    path = checkpoints.save("LlamaForCausalLM", num_hidden_layers=layers)
    reference = checkpoints.reference(path)
    reads = record_window_reads(monkeypatch)
    two = _llm(path, pipeline_parallel_size=2, pipeline_micro_batches=micro_batches)
    try:
        assert two.llm_engine.runner.micro_batches == (micro_batches or 2)
        assert two.llm_engine.model.num_local_layers == (layers + 1) // 2
        # stage 0 read only its own layers' tensors (and the embedding), none of stage 1's
        assert not [t for t in reads if t.name.startswith(f"model.layers.{layers - 1}.")]
        assert len(two.llm_engine.block_cache.kv_caches) == (layers + 1) // 2  # KV for its own layers only
        reference.assert_matched_by(two)
    finally:
        two.shutdown()
    assert multiprocessing.active_children() == []


def test_a_post_norm_model_is_refused_pipeline_parallel_and_no_worker_is_left(hf_tokenizer_dir, tmp_path):
    path = save_tiny("Gemma2ForCausalLM", str(tmp_path), hf_tokenizer_dir, head_dim=32)
    with pytest.raises(EngineConfigError, match="post-norm models .* do not run pipeline-parallel yet"):
        _llm(path, pipeline_parallel_size=2)
    assert multiprocessing.active_children() == []


def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(
    tiny_llama_dir, hf_tokenizer_dir, tmp_path, monkeypatch
):
    def no_workers(*args, **kwargs):
        raise AssertionError("a rank process was started for a model that cannot split")

    monkeypatch.setattr(engine_setup, "start_rank_workers", no_workers)
    with pytest.raises(EngineConfigError, match="4 attention heads do not split over tensor_parallel_size 3"):
        _llm(tiny_llama_dir, tensor_parallel_size=3)
    moe = save_tiny("MixtralForCausalLM", str(tmp_path), hf_tokenizer_dir, num_local_experts=3, num_experts_per_tok=2)
    with pytest.raises(EngineConfigError, match="3 experts do not divide among 2 expert-parallel ranks"):
        _llm(moe, tensor_parallel_size=2, enable_expert_parallel=True)
    mla = save_tiny(
        "DeepseekV3ForCausalLM", str(tmp_path / "mla"), hf_tokenizer_dir, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, kv_lora_rank=56, qk_rope_head_dim=8, head_dim=8, num_key_value_heads=4,
    )  # fmt: skip
    with pytest.raises(EngineConfigError, match="latent attention does not split over tensor-parallel ranks yet"):
        _llm(mla, tensor_parallel_size=2)
    assert multiprocessing.active_children() == []


#: GLM-4.5's layout (a dense first layer, sigmoid routing with a bias over groups, a shared expert) and
#: Qwen2-MoE's (a shared expert behind a sigmoid gate), 8 experts of width 32
MOE_CASES = {
    "Glm4MoeForCausalLM": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, intermediate_size=64,
        use_qk_norm=True, attention_bias=True, pad_token_id=0,
    ),
    "Qwen2MoeForCausalLM": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
    ),
    # gpt-oss: experts stacked in one tensor per projection, biases on both (the down bias added once),
    # attention sinks split with the heads
    "GptOssForCausalLM": dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
    ),
}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts_split", "experts_divided"])
@pytest.mark.parametrize("architecture", list(MOE_CASES))
def test_two_ranks_run_a_mixture_of_experts_as_one_process(architecture, expert_parallel, checkpoints, monkeypatch):
    """Each rank holds half of every expert's width, or (expert parallelism) four whole experts, and half of
    the shared expert's width; the ranks' sums give one process's tokens and logits (the two cases of an
    architecture share its checkpoint and single-process reference)."""
    path = checkpoints.save(architecture, **MOE_CASES[architecture])
    one, reference = checkpoints.engine(path), checkpoints.reference(path)
    reads = record_window_reads(monkeypatch)
    two = _llm(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    try:
        experts = [t for t in reads if ".experts." in t.name]
        if architecture == "GptOssForCausalLM":  # stacked: a rank reads its experts' rows, or all of them
            assert experts and all(t.shape[0] * (2 if expert_parallel else 1) == t.full_shape[0] for t in experts)
        elif expert_parallel:  # rank 0 read experts 0-3 whole and nothing of the others
            assert {int(t.name.split(".experts.")[1].split(".")[0]) for t in experts} == {0, 1, 2, 3}
            assert all(t.shape == t.full_shape for t in experts)
        else:
            assert len({t.name for t in experts}) == 8 * 3 * (len(one.llm_engine.model.layers) - ("Glm4" in architecture))
            assert all(math.prod(t.shape) * 2 == math.prod(t.full_shape) for t in experts)
        reference.assert_matched_by(two)
    finally:
        two.shutdown()
    assert multiprocessing.active_children() == []


def test_two_ranks_keep_a_gptq_mixtures_experts_quantized(checkpoints, tmp_path, monkeypatch):
    """A GPTQ Qwen3-MoE (4-bit, groups of 32, experts 64 wide): each rank's share of every expert (its 32 gate and
    up rows and 32 down columns, one whole group) reaches its backend still quantized, and the ranks give one
    process's tokens and logits."""
    from prequantized_checkpoints import write_gptq

    from engine.interfaces.gemm import QuantizedWeight
    from engine_plugin_cpu.gemm import CpuGemmBackend

    plain = checkpoints.save("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    path = str(tmp_path / "gptq")
    write_gptq(plain, path, str(tmp_path / "reference"), bits=4, group=32, symmetric=False, act_order=False)
    reference = checkpoints.reference(path)
    shapes: list[tuple[str, tuple[int, int]]] = []
    prepare = CpuGemmBackend.prepare_experts

    def recording(self, gate_up, down, *args):
        shapes.extend((w.scheme if isinstance(w, QuantizedWeight) else "dense", tuple(w.shape)) for w in gate_up + down)
        return prepare(self, gate_up, down, *args)

    monkeypatch.setattr(CpuGemmBackend, "prepare_experts", recording)
    two = _llm(path, tensor_parallel_size=2)
    try:
        layers = len(two.llm_engine.model.layers)
        want = ([("int4_grouped", (64, 128))] * 8 + [("int4_grouped", (128, 32))] * 8) * layers
        assert shapes == want
        reference.assert_matched_by(two)
    finally:
        two.shutdown()
    assert multiprocessing.active_children() == []


def test_two_stages_of_two_tensor_parallel_ranks_give_one_process_tokens_and_logits(tiny_llama_dir, checkpoints):
    reference = checkpoints.reference(tiny_llama_dir)
    four = _llm(tiny_llama_dir, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        model = four.llm_engine.model
        assert len(four.llm_engine.workers.processes) == 3
        assert (model.num_local_layers, model.num_heads, model.tp.rank, model.pp.stage) == (1, 2, 0, 0)
        reference.assert_matched_by(four)
    finally:
        four.shutdown()
    assert multiprocessing.active_children() == []


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads child processes from /proc")
def test_serve_with_two_ranks_answers_the_openai_client_and_leaves_no_child(tiny_llama_dir, checkpoints):
    import openai

    from engine.entrypoints.openai.launcher import ServerProcess

    one = checkpoints.engine(tiny_llama_dir)
    expected = one.generate(["The quick brown fox"], GREEDY, use_tqdm=False)[0].outputs[0].text
    server = ServerProcess([
        "--model", tiny_llama_dir, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB",
        "--tensor-parallel-size", "2",
    ]).start()  # fmt: skip
    try:
        assert server.proc is not None
        core, workers = engine_core_children(server.proc.pid)
        assert len(workers) == 1, workers
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        answer = client.completions.create(
            model=client.models.list().data[0].id, prompt="The quick brown fox", max_tokens=GREEDY.max_tokens,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert answer.choices[0].text == expected
        assert server.stop(signal.SIGTERM, timeout_s=60) == 0
    finally:
        server.kill()
    assert not [pid for pid in [core, *workers] if os.path.exists(f"/proc/{pid}") and process_state(pid) != "Z"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads child processes from /proc")
def test_a_rank_that_dies_fails_its_requests_and_the_server_exits_non_zero(tiny_llama_dir):
    import httpx

    from engine.entrypoints.openai.launcher import ServerProcess

    server = ServerProcess([
        "--model", tiny_llama_dir, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB",
        "--tensor-parallel-size", "2",
    ]).start()  # fmt: skip
    try:
        assert server.proc is not None
        core, (worker,) = engine_core_children(server.proc.pid)
        model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # generating
            os.kill(worker, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        # the stream ends with an error, never with [DONE] after a full answer
        assert rest and "error" in rest[-1] or "error" in "".join(rest), rest[-3:]
        assert server.proc.wait(60) == 1
        assert "rank 1 was killed by signal 9" in server.log_tail()
    finally:
        server.kill()
    assert not [pid for pid in [core, worker] if os.path.exists(f"/proc/{pid}") and process_state(pid) != "Z"]


@pytest.mark.slow
def test_two_ranks_verify_host_proposals_as_one_process(tiny_llama_dir, checkpoints):
    """n-gram proposals (made on the driver's host) verified by two tensor-parallel ranks: the tokens of one
    process without speculation, proposals made and blocks all free afterwards. (Its configuration reaches
    the ranks as JSON, which a speculative config did not survive before.)"""
    repeat = ["1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", "the cat the cat the cat the cat the"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "auto_disable": False}
    one = checkpoints.engine(tiny_llama_dir)
    expected = [o.outputs[0].token_ids for o in one.generate(repeat, params, use_tqdm=False)]
    two = _llm(tiny_llama_dir, tensor_parallel_size=2, speculative_config=spec)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(repeat, params, use_tqdm=False)] == expected
        assert two.llm_engine.stats()["spec_num_proposed_tokens"] > 0
        assert_all_blocks_free(two)
    finally:
        two.shutdown()
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_two_ranks_verify_a_draft_models_proposals_as_one_process(tiny_llama_dir, checkpoints):
    """A draft model (whole, on the driver) proposing for a target split over two tensor-parallel ranks: the
    target itself as its draft (every proposal accepted), then a draft of another architecture (a tiny
    Qwen2, the module's own; proposals mostly refused); both give the tokens of one process without
    speculation, blocks all free."""
    prompts = ["1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", "the cat the cat the cat the cat the", "Hello there"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = checkpoints.engine(tiny_llama_dir)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    qwen2 = checkpoints.save("Qwen2ForCausalLM", num_key_value_heads=1)
    for draft in (tiny_llama_dir, qwen2):
        spec = {"model": draft, "num_speculative_tokens": 3, "auto_disable": False}
        two = _llm(tiny_llama_dir, tensor_parallel_size=2, speculative_config=spec)
        try:
            assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == expected
            stats = two.llm_engine.stats()
            assert stats["spec_num_proposed_tokens"] > 0
            if draft == tiny_llama_dir:
                assert stats["spec_num_accepted_tokens"] == stats["spec_num_proposed_tokens"]
            assert_all_blocks_free(two)
        finally:
            two.shutdown()
    assert multiprocessing.active_children() == []

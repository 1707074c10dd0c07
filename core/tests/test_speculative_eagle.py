"""Speculative decoding with EAGLE heads (``eagle``, ``eagle3``) written in the published checkpoint layouts:
the head's forward equals a hand-written reference of the architecture, the head reads the target's hidden
state of every position it computes, greedy tokens are identical with and without it (several prompts,
chunked prefill, prefix-cache hits), a head built to predict a target exactly has every proposal accepted,
seeded sampling repeats, every KV block of both pools is free afterwards, and what cannot run is refused
in one line."""

from __future__ import annotations

import os

import pytest
import torch
from dense_model_utils import PROMPTS, save_tiny
from eagle_heads import load_target_tensors, reference_head, save_eagle_head

from engine import LLM, SamplingParams
from engine.errors import EngineConfigError
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine_test_utils import assert_all_blocks_free

KV = 16 << 20
#: shared prefixes, so the second of two identical runs starts from cached blocks
PREFIXED = [PROMPTS[0] + " and " + tail for tail in ("bread", "cheese is sold", "a long river")] + PROMPTS[1:4]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, hf_tokenizer_dir) -> str:
    """A tiny Llama of eight layers, so that an EAGLE-3 head reads its default layers 2, 4 and 5."""
    return save_tiny("LlamaForCausalLM", str(tmp_path_factory.mktemp("eagle-target")), hf_tokenizer_dir, seed=3, num_hidden_layers=8)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle-heads")
    return {
        "eagle": save_eagle_head(str(root / "eagle"), target_dir, seed=5),
        "eagle3": save_eagle_head(str(root / "eagle3"), target_dir, seed=6, kind="eagle3", draft_vocab_size=4096),
    }


def _llm(target: str, head: str | None = None, method: str = "eagle", k: int = 3, **kwargs) -> LLM:
    spec = None if head is None else {"method": method, "model": head, "num_speculative_tokens": k, "auto_disable": False}
    return LLM(model=target, device="cpu", dtype="float32", kv_cache_memory_bytes=KV, speculative_config=spec, **kwargs)


def _greedy(llm: LLM, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


class PlainTargets:
    """The greedy tokens of targets without a head, the references of the tests: each target's plain engine
    is built once for the module and each (prompts, length) run once. The engines cache no prefix blocks, so
    every run computes its prompts from scratch, as a fresh engine would."""

    def __init__(self) -> None:
        self.engines: dict[str, LLM] = {}
        self.tokens: dict[tuple[str, tuple[str, ...], int], list[list[int]]] = {}

    def greedy(self, target: str, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
        key = (target, tuple(prompts), max_tokens)
        if key not in self.tokens:
            if target not in self.engines:
                self.engines[target] = _llm(target, enable_prefix_caching=False)
            self.tokens[key] = _greedy(self.engines[target], prompts, max_tokens)
        return self.tokens[key]


@pytest.fixture(scope="module")
def plain():
    targets = PlainTargets()
    yield targets
    for llm in targets.engines.values():
        llm.shutdown()


def _assert_head_free(llm: LLM) -> None:
    eagle = llm.llm_engine.speculator.eagle
    assert eagle is not None and not eagle.mirrors
    bm = eagle.parts.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_head_forward_equals_a_reference_of_the_architecture(target_dir, heads, method):
    """One step of the engine's head over 7 positions, float32, against the architecture written out in
    torch on the same weights: its output hidden states and logits agree within 1e-5."""
    llm = _llm(target_dir, heads[method], method)
    parts = llm.llm_engine.speculator.eagle.parts
    target = load_target_tensors(target_dir)
    tokens = [5, 900, 33, 4012, 17, 250, 3000]
    width = 3 * 128 if method == "eagle3" else 128
    hidden = torch.randn(len(tokens), width, generator=torch.Generator().manual_seed(0))
    mirror = Sequence(10**6, "unit", 0, tokens, SamplingParams(temperature=0.0), 0)
    parts.block_manager.allocate(mirror.seq_id, len(tokens))
    parts.head.use_hidden(hidden)
    logits = parts.runner.prefill_logits(SchedulerOutput([ScheduledSequence(mirror, len(tokens), True)]))
    out = parts.head.last_hidden
    parts.block_manager.free(mirror.seq_id)
    ref_out, ref_logits = reference_head(heads[method], target["model.embed_tokens.weight"], target["lm_head.weight"], tokens, hidden)
    assert (out - ref_out).abs().max() < 1e-5
    finite = torch.isfinite(ref_logits)
    assert torch.equal(finite, torch.isfinite(logits))
    assert (logits[finite] - ref_logits[finite]).abs().max() < 1e-5
    if method == "eagle3":  # only the draft vocabulary's ids (every 12th target id) can be proposed
        assert int(finite[0].sum()) == 4096 and bool(finite[0, 12]) and not bool(finite[0, 1])


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_head_reads_the_target_hidden_state_of_each_position(target_dir, heads, method, monkeypatch):
    """Every hidden-state row the head is given is the target's at that position (EAGLE-1: after the final
    norm; EAGLE-3: the inputs of layers 2, 4 and 5), as transformers computes them over the final tokens:
    the rows of accepted tokens reach the head, those of rejected proposals never do."""
    from transformers import LlamaForCausalLM

    llm = _llm(target_dir, heads[method], method, enable_prefix_caching=False, max_num_batched_tokens=16)
    store = llm.llm_engine.speculator.eagle.parts.store
    seen: list[tuple[int, int, torch.Tensor]] = []
    gather = store.gather

    def recording(seq_id: int, first: int, last: int) -> torch.Tensor:
        rows = gather(seq_id, first, last)
        seen.append((seq_id, first, rows.clone()))
        return rows

    monkeypatch.setattr(store, "gather", recording)
    prompts = PROMPTS[:3]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    hf = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    by_seq = {}
    for out in outs:
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        with torch.no_grad():
            states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        rows = states[-1][0] if method == "eagle" else torch.cat([states[i][0] for i in (2, 4, 5)], dim=-1)
        by_seq[tuple(ids[: len(out.prompt_token_ids)])] = rows
    engine_seqs = {}
    assert seen
    for seq_id, first, rows in seen:
        engine_seqs.setdefault(seq_id, []).append((first, rows))
    assert len(engine_seqs) == len(prompts)
    for ref in by_seq.values():
        # match each engine sequence to its prompt by its first row
        seq_rows = next(r for r in engine_seqs.values() if r[0][0] == 0 and (r[0][1][0] - ref[0]).abs().max() < 1e-4)
        covered = 0
        for first, rows in seq_rows:
            assert first == covered  # every position once, in order
            assert (rows - ref[first : first + rows.shape[0]]).abs().max() < 1e-4
            covered += rows.shape[0]
        assert covered >= ref.shape[0] - 2 - 3  # up to the last round's catch-up


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_tokens_are_unchanged_with_an_eagle_head(target_dir, heads, method, plain):
    """Several prompts in one batch, prefills in chunks of 16 tokens, then the same prompts again from the
    prefix cache (positions the target did not compute read zero hidden states)."""
    expected = plain.greedy(target_dir, PREFIXED)
    spec = _llm(target_dir, heads[method], method, max_num_batched_tokens=16)
    assert _greedy(spec, PREFIXED) == expected
    assert _greedy(spec, PREFIXED) == expected
    stats = spec.llm_engine.stats()
    assert stats["spec_method"] == method
    assert stats["spec_num_proposed_tokens"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert_all_blocks_free(spec)
    _assert_head_free(spec)


@pytest.fixture(scope="module")
def bigram(tmp_path_factory, hf_tokenizer_dir) -> tuple[str, str]:
    """A one-layer Llama whose attention output is zero (``o_proj`` zero), whose embeddings have unit RMS
    and whose norm scales are one: its next token depends on the current token only. An EAGLE-1 head whose
    ``fc`` passes the embedding through and whose layer is the target's layer computes the same function
    of its input token, which is the target's next token: every greedy proposal is the target's own."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("bigram")
    target = save_tiny("LlamaForCausalLM", str(root / "target"), hf_tokenizer_dir, seed=8, num_hidden_layers=1)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.input_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(target)
    weights = load_target_tensors(target)
    h = emb.shape[1]
    copied = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.layers.0.") and "input_layernorm" not in k}
    head = save_eagle_head(
        str(root / "head"), target, fc_bias=False,
        tensors={**copied, "fc.weight": torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)},
    )  # fmt: skip
    return target, head


def test_a_head_that_reproduces_the_target_has_its_proposals_accepted(bigram, plain):
    target, head = bigram
    expected = plain.greedy(target, PROMPTS, 17)
    spec = _llm(target, head, k=4)
    assert _greedy(spec, PROMPTS, 17) == expected
    stats = spec.llm_engine.stats()
    # 17 tokens: the prefill's, three verified steps of 4 proposals and a bonus token, then one plain decode
    assert stats["spec_acceptance_rate"] == 1.0, stats
    assert stats["spec_num_proposed_tokens"] == 3 * 4 * len(PROMPTS)
    assert stats["spec_mean_accepted_length"] == 5.0
    assert_all_blocks_free(spec)
    _assert_head_free(spec)


@pytest.mark.slow
def test_each_data_parallel_replica_runs_a_head_of_its_own(bigram, plain):
    """Two replicas, each with the head beside its model: the same greedy tokens as one plain engine, and
    every replica's proposals accepted (the engine's statistics sum the replicas')."""
    target, head = bigram
    expected = plain.greedy(target, PROMPTS, 17)
    dp = _llm(target, head, k=4, data_parallel_size=2)
    try:
        assert _greedy(dp, PROMPTS, 17) == expected
        stats = dp.llm_engine.stats()
        assert stats["spec_num_proposed_tokens"] == 3 * 4 * len(PROMPTS), stats
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_proposed_tokens"], stats
        assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] == 5.0, stats
        assert stats["spec_method"] == "eagle"
    finally:
        dp.shutdown()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_seeded_sampling_repeats_with_an_eagle_head(target_dir, heads, method):
    spec = _llm(target_dir, heads[method], method, k=2)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    first = [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:4], params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:4], params, use_tqdm=False)]
    assert first == again and all(first)
    assert spec.llm_engine.stats()["spec_num_proposed_tokens"] > 0
    assert_all_blocks_free(spec)
    _assert_head_free(spec)


def test_heads_that_cannot_serve_the_target_are_one_line_errors(target_dir, heads, tmp_path, hf_tokenizer_dir):
    shallow = save_tiny("LlamaForCausalLM", str(tmp_path / "shallow"), hf_tokenizer_dir, seed=1)
    wide = save_tiny("LlamaForCausalLM", str(tmp_path / "wide"), hf_tokenizer_dir, seed=1, hidden_size=256, num_hidden_layers=8)
    wide_head = save_eagle_head(str(tmp_path / "wide-head"), wide, seed=2)
    odd = save_eagle_head(str(tmp_path / "odd"), target_dir, seed=2, tensors={"extra.weight": torch.zeros(2)})
    cases = (
        (target_dir, {"method": "eagle", "num_speculative_tokens": 2}, "needs the EAGLE head's model"),
        (target_dir, {"method": "eagle", "model": str(tmp_path / "missing"), "num_speculative_tokens": 2}, "speculative_config model"),
        (target_dir, {"method": "eagle", "model": wide_head, "num_speculative_tokens": 2}, "hidden size 256 differs from the target's 128"),
        (shallow, {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": 2}, "three distinct layers"),
        (target_dir, {"method": "eagle", "model": odd, "num_speculative_tokens": 2}, "not in the eagle head layout: extra.weight"),
        (target_dir, {"method": "eagle", "model": heads["eagle"], "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "prompt_lookup_max is a setting of method 'ngram'"),
    )
    for model, config, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            LLM(model=model, device="cpu", kv_cache_memory_bytes=KV, speculative_config=config)
        if isinstance(err.value, EngineConfigError):  # (the others are the configuration's validation errors)
            assert "\n" not in str(err.value)


def test_eagle_refuses_pipeline_stages(target_dir, heads):
    """Checked before any rank starts: the head runs beside rank 0's model only, which under pipeline
    parallelism holds no LM head (tensor parallelism is fine: see the next test)."""
    from engine.config import EngineConfig, ParallelConfig
    from engine.speculative.eagle_setup import load_eagle

    config = EngineConfig(
        model=target_dir, parallel=ParallelConfig(pipeline_parallel_size=2),
        speculative_config={"method": "eagle", "model": heads["eagle"], "num_speculative_tokens": 2},
    )  # fmt: skip
    with pytest.raises(EngineConfigError, match="speculative_config method 'eagle' runs on one rank; pipeline"):
        load_eagle(config, None, None, None)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_head_beside_two_tensor_parallel_ranks_gives_one_process_tokens(target_dir, heads, bigram, plain):
    """The driver runs the head with whole copies of the target's embeddings and LM head beside its shard:
    EAGLE-1 and EAGLE-3 heads give the greedy tokens of one plain process, and a head that reproduces the
    target has every proposal accepted."""
    cases = [(target_dir, heads["eagle"], "eagle", 16), (target_dir, heads["eagle3"], "eagle3", 16), (*bigram, "eagle", 17)]
    for target, head, method, tokens in cases:
        expected = plain.greedy(target, PROMPTS[:4], tokens)  # (one plain run for both heads of target_dir)
        two = _llm(target, head, method, k=4 if tokens == 17 else 3, tensor_parallel_size=2)
        try:
            assert _greedy(two, PROMPTS[:4], tokens) == expected, (target, method)
            stats = two.llm_engine.stats()
            assert stats["spec_num_proposed_tokens"] > 0
            if tokens == 17:
                assert stats["spec_acceptance_rate"] == 1.0, stats
            assert_all_blocks_free(two)
            _assert_head_free(two)
        finally:
            two.shutdown()


def test_the_hidden_states_live_beside_the_kv_blocks():
    """Rows are written at their KV slots (a recomputed position holds its newest row), follow the step's
    copy-on-write copies and swaps, and read as zeros where the sequence holds no block."""
    from types import SimpleNamespace

    from engine.block_manager import BlockManager
    from engine.speculative.eagle_hidden import HiddenStore

    bm = BlockManager(4, 2)
    table = bm.allocate(7, 4)
    store = HiddenStore(2, bm, 4, torch.float32, torch.device("cpu"))

    def slots(*positions: int) -> SimpleNamespace:
        return SimpleNamespace(slot_mapping=torch.tensor([bm.slot(7, p) for p in positions]))

    store.keep(SchedulerOutput(), torch.arange(8.0).view(4, 2), slots(0, 1, 2, 3))
    store.keep(SchedulerOutput(), -torch.ones(1, 2), slots(3))  # position 3 recomputed
    assert store.gather(7, 1, 5).tolist() == [[2.0, 3.0], [4.0, 5.0], [-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]]
    free = next(b for b in range(4) if b not in table)
    store.keep(SchedulerOutput(copies=[(table[1], free)], swap_out=[(table[0], 9)]), torch.zeros(0, 2), slots())
    bm.block_tables[7] = [table[0], free]
    assert store.gather(7, 2, 3).tolist() == [[4.0, 5.0], [-1.0, -1.0]]
    store.keep(SchedulerOutput(swap_in=[(9, table[1])]), torch.zeros(0, 2), slots())
    bm.block_tables[7] = [table[1], free]
    assert store.gather(7, 0, 1).tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert store.gather(8, 0, 0).tolist() == [[0.0, 0.0]]


def test_cli_names_a_missing_eagle_head_in_one_line(target_dir, tmp_path, capfd, caplog, monkeypatch):
    """``engine generate`` through the command's entry point, in this process (no second interpreter to
    import torch): its exit status is 1 and all it writes to stderr (file descriptor 2 included) is one line.
    Warnings logged on the way would reach stderr in a process of its own, through logging's last-resort
    handler, so none may be logged here either."""
    import logging

    from engine.entrypoints.cli import main

    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))  # (main sets a default)
    config = '{"method": "eagle", "model": "%s", "num_speculative_tokens": 2}' % (tmp_path / "no-such-head")
    with caplog.at_level(logging.WARNING):
        code = main(["generate", "hello", "--model", target_dir, "--device", "cpu", "--speculative-config", config])
    err = capfd.readouterr().err.strip()
    assert code == 1
    assert len(err.splitlines()) == 1 and err.startswith("error: speculative_config model"), err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize(("method", "graphs"), [("eagle", True), ("eagle3", False)])
def test_eagle3_targets_record_no_decode_graphs(target_dir, heads, method, graphs, monkeypatch):
    """On a platform that records decode graphs, an EAGLE-1 target keeps them (a graph's output is the
    hidden state the head reads), while an EAGLE-3 target, which must hand over its layers' inputs, decodes
    eagerly and records none (they would never replay)."""
    import dataclasses

    from engine_plugin_cpu.platform import CpuPlatform

    claims = CpuPlatform.capabilities
    monkeypatch.setattr(CpuPlatform, "capabilities", lambda self: dataclasses.replace(claims(self), graph_capture=True))
    llm = _llm(target_dir, heads[method], method=method)
    assert (llm.llm_engine.runner.decode_graphs is not None) == graphs
    assert _greedy(llm, ["The capital of France is"], 6) == _greedy(_llm(target_dir), ["The capital of France is"], 6)

"""Structured output's parts: the xgrammar backend's matchers, the compile cache, the token-mask op, the
sampler's raw logprobs, and constrained sequences surviving preemption (tiny model)."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.interfaces.ops import apply_token_bitmask, unpack_token_bitmask
from engine.sampling.sampler import Sampler, SamplingRow
from engine.structured_output import StructuredOutputManager
from engine.structured_output.params import GrammarSpec
from engine_plugin_sdk.reference_ops import ref_apply_token_bitmask
from engine_test_utils import assert_all_blocks_free

xgr = pytest.importorskip("xgrammar")
VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer(smollm_gguf_path):
    from engine.loader import load_tokenizer

    return load_tokenizer(smollm_gguf_path)


@pytest.fixture(scope="module")
def backend(tokenizer):
    from engine.structured_output.xgrammar_backend import XgrammarBackend

    return XgrammarBackend(tokenizer.hf, VOCAB, tokenizer.eos_token_ids)


def allowed_ids(backend, matcher) -> set[int]:
    bitmask = backend.allocate_bitmask(2)
    matcher.fill_next_token_bitmask(bitmask, 1)
    assert (bitmask[0] == -1).all()  # the other row untouched
    return set(unpack_token_bitmask(bitmask[1:], VOCAB)[0].nonzero().flatten().tolist())


def matcher_for(backend, **kind):
    spec = StructuredOutputsParams(**kind).spec()
    return backend.make_matcher(backend.compile(backend.parse(spec)))


def test_bitmask_termination_rollback_and_reset(backend, tokenizer):
    eos = tokenizer.eos_token_ids[0]
    matcher = matcher_for(backend, regex=r"ab[0-9]{2}")
    start = allowed_ids(backend, matcher)
    ids = tokenizer.encode("ab12", add_special_tokens=False)
    assert ids[0] in start and eos not in start
    assert all(tokenizer.decode([t]).startswith("a") or "ab".startswith(tokenizer.decode([t])) for t in start)
    assert matcher.accept_tokens(ids)
    assert allowed_ids(backend, matcher) == {eos} and not matcher.is_terminated()
    matcher.rollback(1)
    after_rollback = allowed_ids(backend, matcher)
    assert ids[-1] in after_rollback and eos not in after_rollback
    assert matcher.accept_token(ids[-1]) and matcher.accept_token(eos) and matcher.is_terminated()
    matcher.reset()
    assert allowed_ids(backend, matcher) == start and not matcher.is_terminated()


def test_refused_tokens_leave_the_state_alone(backend, tokenizer):
    matcher = matcher_for(backend, choice=["yes", "no"])
    before = allowed_ids(backend, matcher)
    bad = tokenizer.encode("maybe", add_special_tokens=False)
    assert not matcher.accept_tokens(bad)
    good = tokenizer.encode("yes", add_special_tokens=False)
    assert not matcher.accept_tokens([*good, bad[0]])  # all or none
    assert allowed_ids(backend, matcher) == before
    assert matcher.accept_tokens(good)


def test_compact_json_and_free_whitespace(backend, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for compact, text in ((True, '{"a":1}'), (False, '{ "a" : 1 }')):
        matcher = matcher_for(backend, json=schema, disable_any_whitespace=compact)
        assert matcher.accept_tokens(tokenizer.encode(text, add_special_tokens=False)), text
    assert not matcher_for(backend, json=schema).accept_tokens(
        tokenizer.encode('{"a": 1}', add_special_tokens=False)
    )


def test_parse_errors_name_the_problem(backend):
    with pytest.raises(ValueError, match=r'invalid structured_outputs.grammar: .*Rule "foo" is not defined'):
        backend.parse(GrammarSpec("grammar", "root ::= foo"))


class _CountingBackend:
    """Counts compilations; ``compile`` waits for ``gate``."""

    vocab_size, bitmask_words = 64, 2

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.compiled: list[object] = []

    def parse(self, spec):
        if spec.text == "bad":
            raise ValueError("bad constraint")
        return spec

    def compile(self, grammar):
        self.gate.wait(10)
        self.compiled.append(grammar)
        if grammar.text == "fails":
            raise ValueError("does not compile")
        return grammar


def test_manager_compiles_once_in_the_background_and_caches():
    backend = _CountingBackend()
    manager = StructuredOutputManager(lambda: backend, cache_size=2)
    try:
        first = manager.compile(StructuredOutputsParams(regex="a+"))
        assert not first.done()  # the caller's thread is not held up
        assert manager.compile(StructuredOutputsParams(regex="a+")) is first
        with pytest.raises(ValueError, match="bad constraint"):
            manager.compile(StructuredOutputsParams(regex="bad"))
        backend.gate.set()
        assert first.result(10).text == "a+"
        failing = manager.compile(StructuredOutputsParams(regex="fails"))
        with pytest.raises(ValueError):
            failing.result(10)
        with pytest.raises(ValueError, match="does not compile"):
            manager.compile(StructuredOutputsParams(regex="fails"))  # a known failure: refused at once
        manager.compile(StructuredOutputsParams(regex="b+")).result(10)
        manager.compile(StructuredOutputsParams(regex="c+")).result(10)
        assert manager.compile(StructuredOutputsParams(regex="a+")) is not first  # evicted (cache of 2)
        assert len(backend.compiled) == 4
    finally:
        backend.gate.set()
        manager.shutdown()


def packed(allowed: torch.Tensor) -> torch.Tensor:
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    bits = torch.zeros(rows, 32 * words, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    w = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_matches_the_reference_and_xgrammar(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=gen).to(dtype)
    allowed = torch.rand(6, 280, generator=gen) < 0.3
    allowed[2] = False
    allowed[2, 279] = True
    bitmask = packed(allowed)
    for indices in (None, torch.tensor([1, 2, 5])):
        got = logits.clone()
        apply_token_bitmask(got, bitmask, indices)
        assert torch.equal(got.double(), ref_apply_token_bitmask(logits, bitmask, indices))
    # the packing is xgrammar's: its own CPU op masks the vocabulary's columns alike
    theirs = logits[:, :280].float().clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=280)
    ours = logits.float().clone()
    apply_token_bitmask(ours, bitmask)
    assert torch.equal(ours[:, :280], theirs)
    assert torch.isinf(ours[:, 280:]).all()


def test_sampler_reports_raw_logprobs_of_masked_picks():
    raw = torch.tensor([[5.0, 1.0, 0.0, -1.0], [0.0, 3.0, 2.0, 1.0]])
    masked = raw.clone()
    masked[0, 0] = masked[1, 1] = float("-inf")
    sampler = Sampler([3], 4)
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    rows = [SamplingRow(greedy, [1], [], None), SamplingRow(SamplingParams(temperature=0.0), [1], [], None)]
    result = sampler(masked, rows, raw_logits=raw)
    assert result.token_ids == [1, 2]
    raw_lp = torch.log_softmax(raw, dim=-1)
    assert result.logprobs == pytest.approx([raw_lp[0, 1].item(), raw_lp[1, 2].item()])
    assert result.ranks == [2, 2]
    assert result.top_logprobs[0][0][0] == 0  # the model's favourite, though masked


def test_preemption_keeps_constrained_outputs(tiny_llama_dir):
    # a random tiny model: only the grammar makes its output valid; 12 blocks of 8 tokens force preemption
    prompts = ["Phone number:", "Another one, please:", "A third number to call:", "And one more:"]
    params = SamplingParams(
        max_tokens=24,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}( ext \d{1,3})?"),
    )
    roomy = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20)
    expected = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    small = LLM(
        model=tiny_llama_dir,
        device="cpu",
        dtype="float32",
        block_size=8,
        num_blocks_override=6,
        max_num_batched_tokens=64,
    )
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == expected
    for text in expected:
        assert re.fullmatch(r"\d{3}-\d{4}( ext \d{1,3})?", text), text
    assert small.llm_engine.structured.num_matchers == 0
    assert_all_blocks_free(small)


def test_many_rows_are_filled_together_as_one_by_one(backend, tokenizer):
    """A step's rows filled in shards on several threads give the bitmask the rows filled in turn give, rows
    in any order and at any state of their grammars; unconstrained rows stay all-allowed."""
    from engine.structured_output.xgrammar_backend import BATCH_FILL_MIN_ROWS, XgrammarBackend

    kinds = [dict(regex=r"ab[0-9]{2}"), dict(choice=["yes", "no", "maybe"]), dict(json={"type": "object"})]
    matchers = []
    for i in range(BATCH_FILL_MIN_ROWS + 4):
        matcher = matcher_for(backend, **kinds[i % len(kinds)])
        if i % 3 == 0:  # some rows a token into their grammar
            allowed = sorted(allowed_ids(backend, matcher))
            first = allowed[i % len(allowed)]
            assert matcher.accept_token(first)
        matchers.append(matcher)
    rows = [2 * i + 1 for i in range(len(matchers))][::-1]
    one_by_one = backend.allocate_bitmask(2 * len(matchers) + 1)
    for matcher, row in zip(matchers, rows):
        matcher.fill_next_token_bitmask(one_by_one, row)
    sharded = XgrammarBackend(tokenizer.hf, VOCAB, tokenizer.eos_token_ids, fill_threads=3)
    for filler in (backend, sharded):
        together = filler.allocate_bitmask(2 * len(matchers) + 1)
        filler.fill_bitmasks(matchers, together, rows)
        assert torch.equal(together, one_by_one)
        assert (together[0::2] == -1).all()


def test_constrained_greedy_steps_overlap_the_host(tiny_llama_dir, monkeypatch):
    """With async scheduling, constrained greedy steps stay in flight: each is sampled (masks filled)
    once the step before it has been read, and the outputs are those of synchronous steps, for every
    kind of constraint in one batch, next to an unconstrained row."""
    kinds = [dict(regex=r"\d{3}-\d{4}"), dict(choice=["alpha", "beta", "gamma"]), dict(json={"type": "object"}),
             dict(grammar='root ::= "x" [a-z]* "."'), None]
    prompts = ["Phone:", "Pick one:", "As JSON:", "Word:", "Plain text:"]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, **({"structured_outputs": StructuredOutputsParams(**k)} if k else {}))
        for k in kinds
    ]
    sync = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, async_scheduling=False)
    expected = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in sync.generate(prompts, params, use_tqdm=False)]
    overlapped = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20)
    runner = overlapped.llm_engine.runner
    deferred = []
    real = runner.sample_deferred
    monkeypatch.setattr(runner, "sample_deferred", lambda step, fill: (deferred.append(len(step.targets)), real(step, fill)))
    outs = overlapped.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == expected
    assert len(deferred) >= 10  # nearly every step of the batch was sampled after the one before was read
    # the logprobs under the raw logits, whether log-softmaxed (synchronous) or from the picks' normaliser
    sync_logprobs = [o.outputs[0].cumulative_logprob for o in sync.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].cumulative_logprob for o in outs] == pytest.approx(sync_logprobs, rel=1e-5, abs=1e-5)

    assert re.fullmatch(r"\d{3}-\d{4}", outs[0].outputs[0].text) and outs[1].outputs[0].text in ("alpha", "beta", "gamma")
    assert overlapped.llm_engine.structured.num_matchers == 0
    assert_all_blocks_free(overlapped)


def test_a_sampled_row_joining_overlapped_constrained_steps(tiny_llama_dir):
    """Greedy constrained rows run overlapped; then a seeded, sampled constrained request joins, so a step
    that cannot stay in flight follows one that did: its masks must still wait for the tokens in flight.
    Every output is the one the same schedule gives without async scheduling."""
    regex = r"\\d{3}-\\d{4}( ext \\d{1,3})?"

    def run(async_scheduling: bool) -> dict[str, list[int]]:
        llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20,
                  async_scheduling=async_scheduling)  # fmt: skip
        engine = llm.llm_engine
        greedy = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=regex))
        sampled = SamplingParams(max_tokens=12, temperature=0.9, seed=3, structured_outputs=StructuredOutputsParams(json={"type": "object"}))
        engine.add_request("a", "Phone:", greedy)
        engine.add_request("b", "Another phone:", greedy)
        done: dict[str, list[int]] = {}
        for step in range(40):
            if step == 4:
                engine.add_request("c", "As JSON:", sampled)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            if not engine.has_unfinished_requests():
                break
        assert engine.structured.num_matchers == 0
        assert_all_blocks_free(llm)
        return done

    overlapped, synchronous = run(True), run(False)
    assert overlapped == synchronous and set(overlapped) == {"a", "b", "c"}


def test_structural_tag_output(tiny_llama_dir):
    """A structural tag (xgrammar's format: a fixed prefix, then a number between tags) shapes the whole
    output of a random tiny model; given as a dict or as JSON text."""
    import json

    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "tag", "begin": "<n>", "end": "</n>", "content": {"type": "regex", "pattern": "[0-9]{1,4}"}},
    ]}}  # fmt: skip
    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20)
    for given in (tag, json.dumps(tag)):
        params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(structural_tag=given))
        out = llm.generate(["Count:"], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and re.fullmatch(r"Answer: <n>[0-9]{1,4}</n>", out.text), out.text
    assert_all_blocks_free(llm)


def test_a_step_advances_together_as_one_by_one(backend, tokenizer):
    """The backend's one call for a step's rows gives each row's accept and termination that the rows
    advanced one by one give: refused tokens, stop tokens that end a grammar, and ones that cannot yet."""
    from engine.structured_output.backend import StructuredOutputBackend

    eos = tokenizer.eos_token_ids[0]
    yes = tokenizer.encode("yes", add_special_tokens=False)
    digits = tokenizer.encode("ab12", add_special_tokens=False)

    def rows():
        done_choice = matcher_for(backend, choice=["yes", "no"])
        assert done_choice.accept_tokens(yes)
        done_regex = matcher_for(backend, regex=r"ab[0-9]{2}")
        assert done_regex.accept_tokens(digits)
        early = matcher_for(backend, regex=r"ab[0-9]{2}")
        return [done_choice, done_regex, early, matcher_for(backend, choice=["yes", "no"])], [eos, eos, eos, yes[0]]

    matchers, tokens = rows()
    together = backend.advance(matchers, tokens)
    twins, _ = rows()
    assert together == StructuredOutputBackend.advance(backend, twins, tokens)
    assert together == [(True, True), (True, True), (False, False), (True, False)]
    assert [m.is_terminated() for m in matchers] == [True, True, False, False]


def test_the_bitmask_covers_the_tokenizer_not_the_padded_vocabulary(tokenizer, hf_tokenizer_dir, tmp_path):
    """An embedding padded past the tokenizer: the bitmask covers the tokenizer's ids (matchers do not
    carry the padding as special tokens), and a constrained model whose padded columns hold the largest
    logits never samples one (an unconstrained one does)."""
    import json
    import shutil
    from pathlib import Path

    import transformers

    from engine.structured_output.xgrammar_backend import XgrammarBackend

    padded = XgrammarBackend(tokenizer.hf, VOCAB + 320, tokenizer.eos_token_ids)
    assert padded.vocab_size == VOCAB and padded.bitmask_words == VOCAB // 32

    config = transformers.LlamaConfig(
        vocab_size=VOCAB + 64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[VOCAB:] *= 200  # the padding's logits dwarf every real token's
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(hf_tokenizer_dir) / name, tmp_path / name)
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    plain = llm.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert max(plain[0].outputs[0].token_ids) >= VOCAB  # the control: unmasked, the padding wins
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = llm.generate(
        ["Hi"], SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)),
        use_tqdm=False,
    )[0].outputs[0]
    assert max(out.token_ids) < VOCAB
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text)["a"], int)
    assert llm.llm_engine.structured.num_matchers == 0
    assert_all_blocks_free(llm)

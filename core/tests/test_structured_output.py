"""Structured output through the public ``LLM`` API on the embedded SmolLM2: every answer parses and fits."""

from __future__ import annotations

import json
import re
import threading

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.beam_search import BeamSearchParams
from engine.structured_output import StructuredOutputManager
from engine_test_utils import assert_all_blocks_free

jsonschema = pytest.importorskip("jsonschema")

POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5},
        "y": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["x", "y"],
    "additionalProperties": False,
}
#: bounded so that even a sampled answer ends well within max_tokens
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 10},
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                },
                "required": ["name", "id"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "ref": {
        "$defs": {"point": POINT},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "anyof": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 100},
                    {"type": "string", "maxLength": 6},
                ]
            }
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "ranges": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 65},
            "score": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
}
PROMPT = "Answer in JSON. Describe something:"


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", kv_cache_memory_bytes=256 << 20)


def constrained(max_tokens: int = 48, **kind) -> SamplingParams:
    sampling = {
        k: kind.pop(k) for k in ("temperature", "seed", "n", "logprobs", "top_p", "top_k") if k in kind
    }
    return SamplingParams(
        max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kind), **sampling
    )


def assert_released(llm: LLM) -> None:
    assert llm.llm_engine.structured.num_matchers == 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 0.8, "seed": 7},
        {"temperature": 0.8, "seed": 8, "top_p": 0.9, "top_k": 40},
    ],
)
def test_json_schemas_give_valid_json(llm, sampling):
    names = list(SCHEMAS)
    params = [constrained(json=SCHEMAS[name], **sampling) for name in names]
    outs = llm.generate([PROMPT] * len(names), params, use_tqdm=False)
    for name, out in zip(names, outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name])
        # compact by default: no whitespace outside string literals
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", c.text)), c.text
    assert_released(llm)


def test_a_large_batch_masks_started_in_the_background_change_no_token(llm, monkeypatch):
    """From 16 constrained rows a step's masks are filled on the backend's threads as soon as the step
    before is accepted: the outputs, greedy, are those of masks filled when each step samples, with and
    without logprobs (sampled on the host then), and each is valid JSON."""
    from engine.structured_output.xgrammar_backend import BATCH_FILL_MIN_ROWS, XgrammarBackend

    # the five schemas with short answers (7 to 14 tokens), four rows each: the first rows end while 16 or
    # more still run, the last ones run on below 16. "nested" and "ref" (23 and 29 tokens, checked in
    # test_json_schemas_give_valid_json) would add 15 steps of under 16 rows to each of the three runs.
    short = [name for name in SCHEMAS if name not in ("nested", "ref")]
    names = short * -(-(BATCH_FILL_MIN_ROWS + 4) // len(short))
    prompts = [f"{PROMPT} ({i})" for i in range(len(names))]

    def run(**sampling) -> list:
        params = [constrained(json=SCHEMAS[name], temperature=0.0, **sampling) for name in names]
        outs = [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]
        for name, out in zip(names, outs, strict=True):
            assert out.finish_reason == "stop", (name, out.text)
            jsonschema.validate(json.loads(out.text), SCHEMAS[name])
        assert_released(llm)
        return outs

    started = run()
    with_logprobs = run(logprobs=1)
    assert [o.token_ids for o in with_logprobs] == [o.token_ids for o in started]
    for out in with_logprobs:
        assert len(out.logprobs) == len(out.token_ids)
        assert all(token in step for token, step in zip(out.token_ids, out.logprobs, strict=True))
    monkeypatch.setattr(XgrammarBackend, "fills_in_background", property(lambda self: False))
    at_once = run()
    assert [o.token_ids for o in at_once] == [o.token_ids for o in started]


def test_json_object_and_schema_as_text(llm):
    outs = llm.generate(
        ["Give a JSON object about Paris:", "A point:"],
        [
            constrained(json_object=True, temperature=0.0, max_tokens=64),
            constrained(json=json.dumps(POINT), temperature=0.0),
        ],
        use_tqdm=False,
    )
    first = outs[0].outputs[0]
    assert first.finish_reason in ("stop", "length")
    if first.finish_reason == "stop":
        assert isinstance(json.loads(first.text), dict)
    jsonschema.validate(json.loads(outs[1].outputs[0].text), POINT)
    assert_released(llm)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_regex_outputs_match_fully(llm, temperature):
    patterns = [
        r"\d{3}-\d{4}",
        r"(yes|no)",
        r"[a-z]{2,6}@[a-z]{3,5}\.(com|org)",
        r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?",
    ]
    prompts = ["Phone number:", "Is the sky blue?", "Email address:", "A name:"]
    params = [constrained(regex=p, temperature=temperature, seed=11, max_tokens=24) for p in patterns]
    for pattern, out in zip(patterns, llm.generate(prompts, params, use_tqdm=False), strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), (pattern, c.text)
    assert_released(llm)


def test_choice_and_n_siblings(llm):
    choices = ["Paris", "London", "Berlin", "Madrid"]
    greedy, sampled = llm.generate(
        ["The capital of France is", "Name a European capital:"],
        [
            constrained(choice=choices, temperature=0.0),
            constrained(choice=choices, temperature=1.0, seed=3, n=4),
        ],
        use_tqdm=False,
    )
    assert greedy.outputs[0].text == "Paris"
    assert len(sampled.outputs) == 4
    for c in sampled.outputs:
        assert c.text in choices and c.finish_reason == "stop"
    assert_released(llm)


def test_json_n2_siblings_each_valid_with_logprobs(llm):
    out = llm.generate(
        [PROMPT], constrained(json=SCHEMAS["ref"], temperature=0.9, seed=5, n=2, logprobs=2), use_tqdm=False
    )[0]
    assert len(out.outputs) == 2
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS["ref"])
        # logprobs come from the raw logits: the forced '{' is far from the model's own first choice
        assert len(c.logprobs) == len(c.token_ids)
        first = c.logprobs[0][c.token_ids[0]]
        assert first.rank >= 1 and first.logprob <= 0.0
    assert_released(llm)


def test_ebnf_grammar(llm):
    grammar = """
root ::= "(" num " " op " " num ")"
num ::= [1-9] [0-9]?
op ::= "+" | "-" | "*"
"""
    outs = llm.generate(
        ["An arithmetic expression:"] * 2,
        [constrained(grammar=grammar, temperature=t, seed=2) for t in (0.0, 1.0)],
        use_tqdm=False,
    )
    for out in outs:
        assert re.fullmatch(r"\([1-9][0-9]? [+*-] [1-9][0-9]?\)", out.outputs[0].text), out.outputs[0].text
    assert_released(llm)


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = llm.generate(["The quick brown fox"], plain, use_tqdm=False)[0].outputs[0].token_ids
    # the grammar compiled beforehand: both prompts then prefill in the first step, as "alone" did. (While
    # it compiles, the constrained prompt would join a later step beside the other row's decode, whose
    # bf16 products then take the many-row path, rounded otherwise than a decode step's: a different batch,
    # not a leak of the mask.)
    llm.generate([PROMPT], constrained(json=POINT, temperature=0.0, max_tokens=2), use_tqdm=False)
    outs = llm.generate(
        ["The quick brown fox", PROMPT], [plain, constrained(json=POINT, temperature=0.0)], use_tqdm=False
    )
    assert outs[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(outs[1].outputs[0].text), POINT)
    assert_released(llm)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ({"grammar": "root ::= foo"}, 'Rule "foo" is not defined'),
        ({"regex": "a(b"}, "parenthesis is not closed"),
        ({"json": {"type": "bogus"}}, "bogus"),
    ],
)
def test_compile_errors_are_value_errors_before_any_work(llm, kind, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(
            ["Hi", "Hello"],
            [
                SamplingParams(max_tokens=4),
                SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**kind)),
            ],
            use_tqdm=False,
        )
    assert_released(llm)


def test_params_need_exactly_one_constraint_and_no_beam_search():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="beam search with structured_outputs is not supported"):
        BeamSearchParams(structured_outputs=StructuredOutputsParams(regex="a"))


class _GatedBackend:
    """The engine's backend whose compilations wait for a gate: a grammar still compiling."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self._inner, self._gate = inner, gate
        self.vocab_size, self.bitmask_words = inner.vocab_size, inner.bitmask_words

    def parse(self, spec):
        return self._inner.parse(spec)

    def compile(self, grammar):
        self._gate.wait(30)
        return self._inner.compile(grammar)

    def make_matcher(self, compiled):
        return self._inner.make_matcher(compiled)

    def allocate_bitmask(self, rows):
        return self._inner.allocate_bitmask(rows)

    def fill_bitmasks(self, matchers, bitmask, rows):
        return self._inner.fill_bitmasks(matchers, bitmask, rows)

    def start_step(self, matchers, token_ids, bitmask):
        return self._inner.start_step(matchers, token_ids, bitmask)

    @property
    def fills_in_background(self):
        return self._inner.fills_in_background

    def advance_step(self, matchers, token_ids):
        return self._inner.advance_step(matchers, token_ids)


def test_a_compiling_grammar_does_not_hold_up_other_requests(llm):
    engine = llm.llm_engine
    saved = engine.structured
    gate = threading.Event()
    inner = saved.backend
    engine.structured = StructuredOutputManager(lambda: _GatedBackend(inner, gate))
    try:
        engine.add_request("slow", "A point:", constrained(json=POINT, temperature=0.0))
        engine.add_request("fast", "Hello", SamplingParams(max_tokens=4, temperature=0.0))
        done = {}
        for _ in range(50):
            for out in engine.step():
                done[out.request_id] = out
            if "fast" in done and done["fast"].finished:
                break
        assert done["fast"].finished and "slow" not in done
        gate.set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
        jsonschema.validate(json.loads(done["slow"].outputs[0].text), POINT)
    finally:
        gate.set()
        engine.structured.shutdown()
        engine.structured = saved
    assert_all_blocks_free(llm)


def test_abort_while_compiling_and_while_running(llm):
    engine = llm.llm_engine
    engine.add_request("a", "A point:", constrained(json=SCHEMAS["nested"], temperature=0.0))
    engine.abort_request("a")  # still awaiting its grammar (or queued behind it)
    engine.add_request("b", "A point:", constrained(json=SCHEMAS["nested"], temperature=0.0))
    for _ in range(3):
        engine.step()
    assert engine.structured.num_matchers == 1
    engine.abort_request("b")
    assert_released(llm)

"""Reasoning parsers: recorded outputs of each family, whole and streamed at every cut, agree."""

from __future__ import annotations

import itertools
import random

import pytest
from parser_outputs import REASONING_CASES, TOOLS, ReasoningCase

from engine.reasoning import (
    PluginFileError,
    ReasoningDelta,
    ReasoningParser,
    ReasoningParserRegistry,
    ThinkTagReasoningParser,
    UnknownNameError,
    default_reasoning_parser_registry,
)
from engine.tool_parsers import default_tool_parser_registry


def make_parser(name: str, tokenizer: object = None) -> ReasoningParser:
    return default_reasoning_parser_registry().create(name, tokenizer)


def splits_random(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, pos = [], 0
    while pos < len(text):
        size = rng.choice([0, 1, 1, 2, 3, 4, 5, 8])
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


def stream(parser: ReasoningParser, pieces: list[str]) -> list[ReasoningDelta]:
    s = parser.start_stream()
    deltas = [s.feed(piece) for piece in pieces] + [s.finish()]
    return [d for d in deltas if d is not None]


def joined(deltas: list[ReasoningDelta]) -> tuple[str | None, str | None]:
    for d in deltas:
        assert d.to_dict(), "a delta with nothing in it must not be sent"
        assert d.reasoning_content != "" and d.content != ""
    # reasoning deltas all come before content deltas
    phases = [0 if d.content is None else (1 if d.reasoning_content is None else 0.5) for d in deltas]
    assert phases == sorted(phases)
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return reasoning or None, content or None


@pytest.mark.parametrize("case", REASONING_CASES, ids=lambda c: c.id)
def test_extract_reasoning(case: ReasoningCase) -> None:
    assert make_parser(case.parser).extract_reasoning(case.output) == (case.reasoning, case.content)


@pytest.mark.parametrize("case", REASONING_CASES, ids=lambda c: c.id)
def test_streaming_matches_non_streaming(case: ReasoningCase) -> None:
    whole = make_parser(case.parser).extract_reasoning(case.output)
    cuts = [list(case.output), [case.output]] + [splits_random(case.output, seed) for seed in range(12)]
    for pieces in cuts:
        assert joined(stream(make_parser(case.parser), pieces)) == whole


def test_end_marker_split_across_deltas() -> None:
    s = make_parser("deepseek_r1").start_stream()
    assert s.feed("Two plus two is four.</thi") == ReasoningDelta(reasoning_content="Two plus two is four.")
    assert s.feed("nk>") is None
    assert s.feed("\n\nIt is 4.") == ReasoningDelta(content="It is 4.")
    assert s.finish() is None
    with pytest.raises(RuntimeError):
        s.feed("x")


def test_start_marker_split_across_deltas() -> None:
    s = make_parser("qwen3").start_stream()
    assert s.feed("<th") is None
    assert s.feed("ink>\nLet me") == ReasoningDelta(reasoning_content="Let me")
    assert s.feed(" see.\n</think>") == ReasoningDelta(reasoning_content=" see.")
    assert s.feed("\n\nYes.") == ReasoningDelta(content="Yes.")


def test_is_reasoning_end_on_text() -> None:
    r1, qwen3 = make_parser("deepseek_r1"), make_parser("qwen3")
    assert not r1.is_reasoning_end("still thinking")
    assert r1.is_reasoning_end("done</think>")
    assert not qwen3.is_reasoning_end("")
    assert not qwen3.is_reasoning_end("<thi")
    assert not qwen3.is_reasoning_end("<think>\nhmm")
    assert qwen3.is_reasoning_end("<think>\nhmm</think>")
    assert qwen3.is_reasoning_end("Hello")  # thinking off: the answer starts at once


class FakeTokenizer:
    """The two think markers as single tokens, and a decode that spells ids out."""

    vocab = {"<think>": 100, "</think>": 101}
    unk_token_id = 0

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.vocab.get(token, self.unk_token_id)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join({100: "<think>", 101: "</think>"}.get(i, "x") for i in ids)


class TextOnlyTokenizer(FakeTokenizer):
    """A vocabulary without the markers as tokens: the parser must decode and read the text."""

    vocab: dict[str, int] = {}


def test_is_reasoning_end_on_token_ids() -> None:
    for tokenizer in (FakeTokenizer(), TextOnlyTokenizer()):
        r1, qwen3 = make_parser("deepseek_r1", tokenizer), make_parser("qwen3", tokenizer)
        assert not r1.is_reasoning_end([5, 6])
        assert r1.is_reasoning_end([5, 101, 7])
        assert not qwen3.is_reasoning_end([])
        assert not qwen3.is_reasoning_end([100, 5])
        assert qwen3.is_reasoning_end([100, 5, 101])
        assert qwen3.is_reasoning_end([5, 6])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        make_parser("deepseek_r1").is_reasoning_end([1, 2])


def test_reasoning_then_tool_calls_streamed_through_both_parsers() -> None:
    """How the server chains them: the reasoning stream's content is the tool stream's input."""
    case = next(c for c in REASONING_CASES if c.id == "qwen3-thinking-then-tool-call")
    counter = itertools.count()
    tool_parser = default_tool_parser_registry().create("hermes", id_generator=lambda: f"call_{next(counter)}")
    for pieces in [list(case.output)] + [splits_random(case.output, seed) for seed in range(5)]:
        reasoning_stream, tool_stream = make_parser("qwen3").start_stream(), tool_parser.start_stream(TOOLS)
        reasoning, content, names = [], [], []
        for delta in [reasoning_stream.feed(p) for p in pieces] + [reasoning_stream.finish()]:
            if delta is None:
                continue
            reasoning.append(delta.reasoning_content or "")
            tool_delta = tool_stream.feed(delta.content or "")
            if tool_delta is not None:
                content.append(tool_delta.content or "")
                names += [c.function.name for c in tool_delta.tool_calls]
        last = tool_stream.finish()
        assert last is None or not last.tool_calls
        assert "".join(reasoning) == "I need the weather tool."
        assert "".join(content) == "" and names == ["get_weather"]


def test_registry_and_plugin_file(tmp_path) -> None:
    registry = default_reasoning_parser_registry()
    assert registry.names() == ["deepseek_r1", "openai_gptoss", "qwen3"]
    with pytest.raises(UnknownNameError, match=r"unknown reasoning parser 'qwen'.*deepseek_r1, openai_gptoss, qwen3"):
        registry.get("qwen")
    plugin = tmp_path / "granite_reasoning.py"
    plugin.write_text(
        "from engine.reasoning import ThinkTagReasoningParser\n\n\n"
        "class Thought(ThinkTagReasoningParser):\n"
        "    start_marker = '<thought>'\n"
        "    end_marker = '</thought>'\n"
        "    start_marker_required = True\n\n\n"
        "def register_reasoning_parsers(registry):\n"
        "    registry.register('thought', Thought)\n"
    )
    fresh = ReasoningParserRegistry()
    assert fresh.load_plugin_file(plugin) == ["thought"]
    parser = fresh.create("thought")
    assert isinstance(parser, ThinkTagReasoningParser)
    assert parser.extract_reasoning("<thought>hmm</thought>ok") == ("hmm", "ok")
    assert "thought" not in registry
    with pytest.raises(PluginFileError, match="reasoning parser plugin file .* does not exist"):
        ReasoningParserRegistry().load_plugin_file(tmp_path / "missing.py")

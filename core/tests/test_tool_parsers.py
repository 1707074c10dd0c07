"""Tool-call parsers: recorded outputs of each family, whole and streamed at every cut, agree."""

from __future__ import annotations

import itertools
import json
import random
import re
import time
from collections.abc import Callable, Iterator

import pytest
from parser_outputs import TOOL_CASES, TOOLS, ToolCase

from engine.tool_parsers import (
    CallBlock,
    DeltaMessage,
    ExtractedToolCalls,
    FunctionCall,
    PluginFileError,
    ToolCall,
    ToolParser,
    ToolParserRegistry,
    UnknownNameError,
    default_tool_parser_registry,
    function_names,
)


def counting_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def make_parser(name: str) -> ToolParser:
    return default_tool_parser_registry().create(name, id_generator=counting_ids())


def splits_every_char(text: str) -> list[str]:
    return list(text)


def splits_random(text: str, seed: int) -> list[str]:
    """Token-like pieces: mostly 1-4 characters, sometimes longer, some empty (a token that decodes to
    nothing yet)."""
    rng = random.Random(seed)
    pieces, pos = [], 0
    while pos < len(text):
        size = rng.choice([0, 1, 1, 2, 3, 4, 4, 6, 9])
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


def stream(parser: ToolParser, pieces: list[str]) -> Iterator[DeltaMessage]:
    s = parser.start_stream(TOOLS)
    for piece in pieces:
        delta = s.feed(piece)
        if delta is not None:
            yield delta
    last = s.finish()
    if last is not None:
        yield last


def assemble(deltas: Iterator[DeltaMessage]) -> ExtractedToolCalls:
    """Rebuild a finished message from stream deltas the way an OpenAI client does, checking the shape."""
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        shaped = delta.to_dict()
        json.dumps(shaped)
        assert shaped, "a delta with nothing in it must not be sent"
        if delta.content is not None:
            assert delta.content
            content.append(delta.content)
        for call in delta.tool_calls:
            if call.index not in calls:
                assert call.index == len(calls), "call indexes count up from 0"
                assert call.id and call.type == "function" and call.function.name
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.function.name is None, "id and name are sent once"
            calls[call.index]["arguments"] += call.function.arguments or ""
    tool_calls = [ToolCall(c["id"], FunctionCall(c["name"], c["arguments"])) for _, c in sorted(calls.items())]
    return ExtractedToolCalls(content="".join(content) or None, tool_calls=tool_calls)


@pytest.mark.parametrize("case", TOOL_CASES, ids=lambda c: c.id)
def test_extract_tool_calls(case: ToolCase) -> None:
    result = make_parser(case.parser).extract_tool_calls(case.output, TOOLS)
    assert result.content == case.content
    assert result.tools_called == bool(case.calls)
    assert len(result.tool_calls) == len(case.calls)
    for i, (call, expected) in enumerate(zip(result.tool_calls, case.calls)):
        name, arguments = expected[0], expected[1]
        assert call.type == "function"
        assert call.function.name == name
        assert json.loads(call.function.arguments) == arguments
        assert call.id == (expected[2] if len(expected) > 2 else f"call_{i}")
    if not case.calls:
        # the malformed-output rule: no calls means the output comes back exactly as it was
        assert result.content == (case.output or None)


@pytest.mark.parametrize("case", TOOL_CASES, ids=lambda c: c.id)
def test_streaming_matches_non_streaming(case: ToolCase) -> None:
    whole = make_parser(case.parser).extract_tool_calls(case.output, TOOLS)
    cuts = [splits_every_char(case.output), [case.output]] + [splits_random(case.output, seed) for seed in range(12)]
    for pieces in cuts:
        assert "".join(pieces) == case.output
        assert assemble(stream(make_parser(case.parser), pieces)) == whole


@pytest.mark.parametrize(
    ("parser", "marker"),
    [("hermes", "<tool_call>"), ("llama3_json", "<|python_tag|>"), ("mistral", "[TOOL_CALLS]"), ("pythonic", "<|python_start|>")],
)
def test_no_marker_fragment_leaks_into_content(parser: str, marker: str) -> None:
    case = next(c for c in TOOL_CASES if c.parser == parser and marker in c.output and c.calls)
    for pieces in [splits_every_char(case.output)] + [splits_random(case.output, s) for s in range(5)]:
        for delta in stream(make_parser(parser), pieces):
            for k in range(2, len(marker) + 1):
                assert not (delta.content or "").endswith(marker[:k])


def test_text_is_released_once_it_cannot_start_a_call() -> None:
    s = make_parser("hermes").start_stream(TOOLS)
    assert s.feed("Let me check <tool") == DeltaMessage(content="Let me check")
    assert s.feed("box> first.") == DeltaMessage(content=" <toolbox> first.")
    assert s.feed("\n<tool_call>\n") is None
    delta = s.feed('{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert delta is not None and delta.content is None
    assert [c.to_dict() for c in delta.tool_calls] == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    ]
    assert s.finish() is None
    with pytest.raises(RuntimeError):
        s.feed("more")


def test_tools_none_accepts_any_name_and_names_come_in_several_shapes() -> None:
    out = '<tool_call>\n{"name": "anything", "arguments": {"a": 1}}\n</tool_call>'
    assert make_parser("hermes").extract_tool_calls(out, None).tool_calls[0].function.name == "anything"
    assert not make_parser("hermes").extract_tool_calls(out, TOOLS).tool_calls

    class Function:
        name = "anything"

    class Tool:
        function = Function()

    assert function_names([Tool(), "other", {"function": {"name": "third"}}]) == {"anything", "other", "third"}
    assert make_parser("hermes").extract_tool_calls(out, [Tool()]).tool_calls


def test_default_ids() -> None:
    registry = default_tool_parser_registry()
    mistral = registry.create("mistral").extract_tool_calls("[TOOL_CALLS]get_time[ARGS]{}", TOOLS)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral.tool_calls[0].id)
    hermes = registry.create("hermes").extract_tool_calls('<tool_call>{"name": "get_time"}</tool_call>', TOOLS)
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", hermes.tool_calls[0].id)
    assert hermes.tool_calls[0].function.arguments == "{}"


def test_special_token_needs() -> None:
    registry = default_tool_parser_registry()
    assert registry.create("mistral").adjust_skip_special_tokens(True) is False
    assert registry.create("hermes").adjust_skip_special_tokens(True) is True
    assert registry.create("hermes").tool_call_start_markers == ("<tool_call>",)


def test_huge_or_hostile_outputs_do_not_raise() -> None:
    deep = "[" * 5000 + "]" * 5000
    for name in ("hermes", "llama3_json", "mistral", "openai", "pythonic"):
        parser = make_parser(name)
        for out in (
            deep,
            "<tool_call>" + "{" * 5000,
            '{"name": "get_time", "parameters": ' + "[" * 5000,
            "[TOOL_CALLS]" + deep,
            "<|python_start|>[get_time(x=" + "(" * 500 + ")]",
            "[search(query=1e999)]",
        ):
            result = parser.extract_tool_calls(out, TOOLS)
            assert result.content == out and not result.tool_calls


def test_long_calls_stream_in_linear_time() -> None:
    """A long call fed token by token must not be re-read from its start at a cost that grows with
    its square (the server parses on its event loop)."""
    code = "for i in range(3):\n    print([i, {'k': (i,)}])\n" * 400
    outputs = {
        "hermes": "<tool_call>\n" + json.dumps({"name": "calculate", "arguments": {"code": code}}) + "\n</tool_call>",
        "llama3_json": json.dumps({"name": "calculate", "parameters": {"code": code}}),
        "mistral": "[TOOL_CALLS]calculate[ARGS]" + json.dumps({"code": code}),
        "pythonic": f"[calculate(code={code!r}, rows={[[i, [i]] for i in range(300)]!r})]",
    }
    for name, out in outputs.items():
        start = time.perf_counter()
        result = assemble(stream(make_parser(name), [out[i : i + 4] for i in range(0, len(out), 4)]))
        assert time.perf_counter() - start < 2.0, name
        assert json.loads(result.tool_calls[0].function.arguments)["code"] == code


def test_registry_names_and_errors() -> None:
    registry = default_tool_parser_registry()
    assert registry.names() == ["hermes", "llama3_json", "mistral", "openai", "pythonic"]
    with pytest.raises(UnknownNameError, match=r"unknown tool parser 'hermess'.*hermes, llama3_json.*Did you mean 'hermes'"):
        registry.get("hermess")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("hermes", type(registry.create("hermes")))
    with pytest.raises(TypeError):
        registry.register("bad", object)  # type: ignore[arg-type]
    # registries are independent objects, not one module-level table
    registry.register("copy", type(registry.create("hermes")))
    assert "copy" not in default_tool_parser_registry()


PLUGIN = '''
from engine.tool_parsers import CallBlock, ParsedCall, ToolParser


class AngleParser(ToolParser):
    """<<name>> calls with no arguments."""

    tool_call_start_markers = ("<<",)

    def scan_call_block(self, text, start, final, names, memo):
        end = text.find(">>", start)
        if end < 0:
            return CallBlock(len(text), None) if final else None
        return CallBlock(end + 2, [ParsedCall(text[start + 2 : end], "{}")])


def register_tool_parsers(registry):
    registry.register("angle", AngleParser)
'''


def test_plugin_file(tmp_path) -> None:
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(PLUGIN)
    registry = ToolParserRegistry()
    assert registry.load_plugin_file(plugin) == ["angle"]
    parser = registry.create("angle", id_generator=counting_ids())
    result = parser.extract_tool_calls("Calling <<get_time>> now", None)
    assert result.content == "Calling  now"
    assert [c.function.name for c in result.tool_calls] == ["get_time"]
    assert assemble(stream(registry.create("angle", id_generator=counting_ids()), list("x <<get_time>>"))).tool_calls


def test_plugin_file_errors(tmp_path) -> None:
    registry = ToolParserRegistry()
    with pytest.raises(PluginFileError, match="does not exist"):
        registry.load_plugin_file(tmp_path / "missing.py")
    no_hook = tmp_path / "no_hook.py"
    no_hook.write_text("X = 1\n")
    with pytest.raises(PluginFileError, match="register_tool_parsers"):
        registry.load_plugin_file(no_hook)
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('needs a package')\n")
    with pytest.raises(PluginFileError, match="needs a package"):
        registry.load_plugin_file(broken)
    bad_register = tmp_path / "bad_register.py"
    bad_register.write_text("def register_tool_parsers(registry):\n    registry.register('x', int)\n")
    with pytest.raises(PluginFileError, match="must be a ToolParser subclass"):
        registry.load_plugin_file(bad_register)
    assert registry.names() == []


def test_call_block_contract_is_enforced() -> None:
    class Stuck(ToolParser):
        tool_call_start_markers = ("@",)

        def scan_call_block(self, text, start, final, names, memo):
            return CallBlock(start, None)

    with pytest.raises(AssertionError, match="empty block"):
        Stuck().extract_tool_calls("a @ b")

"""The chat response's split into reasoning, content and tool calls (``serving_tools``), without a
server: streamed pieces agree with the whole whatever the cuts, and the forced-call grammars accept
exactly the calls the tools allow."""

from __future__ import annotations

import json

import pytest

from engine.entrypoints.openai.errors import OpenAIError
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.serving_tools import (
    ChatOutputParser,
    ChatParsers,
    ToolPlan,
    finish_reason,
    merge_answer_deltas,
    plan_tools,
    tool_call_constraint,
    whole_message,
)
from engine.reasoning import default_reasoning_parser_registry
from engine.tool_parsers import default_tool_parser_registry

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "properties": {"zone": {"$ref": "#/$defs/zone"}},
            "required": ["zone"],
        },
    },
}
QWEN_OUTPUT = (
    "<think>\nThe user wants <tool_call> weather.\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


def counter_ids():
    count = iter(range(1000))
    return lambda: f"call_{next(count)}"


def parsers(reasoning: bool = True) -> ChatParsers:
    return ChatParsers(
        tool_parser=default_tool_parser_registry().create("hermes", id_generator=counter_ids()),
        enable_auto_tool_choice=True,
        reasoning_parser=default_reasoning_parser_registry().create("qwen3") if reasoning else None,
    )


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def streamed(plan: ToolPlan, text: str, cut: int) -> dict:
    parser = ChatOutputParser(plan, parsers())
    deltas = [parser.feed(text[i : i + cut]) for i in range(0, len(text), cut)] + [parser.finish()]
    order = [key for d in deltas for key in d]
    # every reasoning delta comes before the first answer delta
    if "reasoning_content" in order and "content" in order:
        assert max(i for i, k in enumerate(order) if k == "reasoning_content") < order.index("content")
    merged = merge_answer_deltas(deltas)
    for call in merged.get("tool_calls", []):
        call.pop("index")
        call["id"] = "x"
    return merged


def test_reasoning_then_tool_calls_on_the_answer_only():
    plan = ToolPlan("auto", [WEATHER])
    parser = ChatOutputParser(plan, parsers())
    message = whole_message(parser, QWEN_OUTPUT)
    # the <tool_call> inside the thinking is not a call: the tool parser reads only the answer
    assert message["reasoning_content"] == "The user wants <tool_call> weather."
    assert message["content"] == "Let me check."
    assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == ["Paris", "Rome"]
    assert [c["id"] for c in message["tool_calls"]] == ["call_0", "call_1"]
    assert finish_reason(parser, "stop") == "tool_calls" and finish_reason(parser, "length") == "length"


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 16, 1000])
def test_streamed_deltas_agree_with_the_whole_message(cut):
    plan = ToolPlan("auto", [WEATHER])
    whole = whole_message(ChatOutputParser(plan, parsers()), QWEN_OUTPUT)
    merged = streamed(plan, QWEN_OUTPUT, cut)
    assert merged["reasoning_content"] == whole["reasoning_content"]
    assert merged["content"] == whole["content"]
    assert [c["function"] for c in merged["tool_calls"]] == [c["function"] for c in whole["tool_calls"]]


def test_without_parallel_tool_calls_only_the_first_call_stands():
    message = whole_message(ChatOutputParser(ToolPlan("auto", [WEATHER], parallel=False), parsers()), QWEN_OUTPUT)
    assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == ["Paris"]


def test_tool_choice_none_leaves_calls_as_text():
    message = whole_message(ChatOutputParser(ToolPlan("none", [WEATHER]), parsers(reasoning=False)), QWEN_OUTPUT)
    assert message == {"role": "assistant", "content": QWEN_OUTPUT}


def test_named_call_streams_its_arguments():
    plan = ToolPlan("named", [WEATHER], function="get_weather")
    parser = ChatOutputParser(plan, parsers())
    first, second = parser.feed('{"city": '), parser.feed('"Paris"}')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert second["tool_calls"][0] == {"index": 0, "function": {"arguments": '"Paris"}'}}
    assert parser.finish() == {}
    # no reasoning is read out of a forced call, even with a reasoning parser configured
    message = whole_message(ChatOutputParser(plan, parsers()), '{"city": "Paris"}')
    assert message["content"] is None and "reasoning_content" not in message
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_required_output_becomes_calls_or_stays_text_when_cut():
    plan = ToolPlan("required", [WEATHER, TIME])
    text = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{"zone":"UTC"}}]'
    parser = ChatOutputParser(plan, parsers())
    message = whole_message(parser, text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert finish_reason(parser, "stop") == "tool_calls"
    cut = whole_message(ChatOutputParser(plan, parsers()), text[:30])
    assert cut["content"] == text[:30] and "tool_calls" not in cut


def test_required_schema_accepts_exactly_the_offered_calls():
    schema = tool_call_constraint(ToolPlan("required", [WEATHER, TIME])).json
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "CET"}}], schema)  # $defs moved up
    for bad in ([], [{"name": "get_time", "parameters": {"zone": "PST"}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_call_constraint(ToolPlan("required", [WEATHER], parallel=False)).json
    assert single["maxItems"] == 1
    named = tool_call_constraint(ToolPlan("named", [WEATHER, TIME], function="get_time")).json
    assert named == TIME["function"]["parameters"]
    assert tool_call_constraint(ToolPlan("auto", [WEATHER])) is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER]}, "tool_choice"),  # auto is the default, and needs the server option
        ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_plan_refusals_name_the_field(fields, param):
    with pytest.raises(OpenAIError) as exc:
        plan_tools(request(**fields), ChatParsers())
    assert exc.value.status == 400 and exc.value.param == param


def test_plans():
    assert plan_tools(request(), ChatParsers()).mode == "none"
    assert plan_tools(request(tools=[WEATHER], tool_choice="none"), ChatParsers()).tools == [WEATHER]
    assert plan_tools(request(tools=[WEATHER]), parsers()).mode == "auto"
    assert plan_tools(request(tools=[WEATHER], tool_choice="required"), ChatParsers()).mode == "required"


GPT_OSS_OUTPUT = (
    "<|channel|>analysis<|message|>The user wants the weather in Paris and Rome.<|end|><|start|>assistant"
    "<|channel|>commentary<|message|>Checking both cities.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|><|start|>assistant to=functions.get_weather'
    '<|channel|>commentary json<|message|>{"city": "Rome"}'
)


def gpt_oss_parsers() -> ChatParsers:
    return ChatParsers(
        tool_parser=default_tool_parser_registry().create("openai", id_generator=counter_ids()),
        enable_auto_tool_choice=True,
        reasoning_parser=default_reasoning_parser_registry().create("openai_gptoss"),
    )


@pytest.mark.parametrize("cut", [1, 2, 5, 13, 1000])
def test_gpt_oss_harmony_reply_splits_into_reasoning_preamble_and_calls(cut):
    """--reasoning-parser openai_gptoss with --tool-call-parser openai: the analysis channel is the reasoning,
    the commentary preamble the content, the messages to functions the calls (either header form, the last
    one cut by its stop token), streamed or whole alike."""
    plan = ToolPlan("auto", [WEATHER])
    parser = ChatOutputParser(plan, gpt_oss_parsers())
    message = whole_message(parser, GPT_OSS_OUTPUT)
    assert message["reasoning_content"] == "The user wants the weather in Paris and Rome."
    assert message["content"] == "Checking both cities."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"}),
    ]  # fmt: skip
    assert finish_reason(parser, "stop") == "tool_calls"
    streamed_parser = ChatOutputParser(plan, gpt_oss_parsers())
    deltas = [streamed_parser.feed(GPT_OSS_OUTPUT[i : i + cut]) for i in range(0, len(GPT_OSS_OUTPUT), cut)]
    merged = merge_answer_deltas([*deltas, streamed_parser.finish()])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert merged["content"] == message["content"]
    assert [c["function"] for c in merged["tool_calls"]] == [c["function"] for c in message["tool_calls"]]


def test_harmony_parsers_ask_for_special_tokens():
    assert default_reasoning_parser_registry().create("openai_gptoss").needs_special_tokens
    assert default_tool_parser_registry().create("openai").adjust_skip_special_tokens(True) is False
    assert not default_reasoning_parser_registry().create("qwen3").needs_special_tokens

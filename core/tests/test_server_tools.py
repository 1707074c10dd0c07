"""Tool calling through the real server with the official ``openai`` client, on the embedded SmolLM2.

SmolLM2's template has no tool support, so the tools reach it in the Hermes format; the model never
writes a real call, so ``auto`` is read with the test-only ``word_calls`` parser
(``chat_parser_plugins.py``), and ``required`` / named calls are forced by the JSON-schema grammar.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.entrypoints.openai.launcher import ServerProcess

pytestmark = pytest.mark.slow

jsonschema = pytest.importorskip("jsonschema")

PLUGINS = os.path.join(os.path.dirname(__file__), "chat_parser_plugins.py")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COUNTRY = {
    "type": "object",
    "properties": {"country": {"type": "string", "enum": ["France", "Spain", "Italy"]}},
    "required": ["country"],
    "additionalProperties": False,
}
CAPITAL = {"type": "function", "function": {"name": "get_capital", "description": "A country's capital", "parameters": COUNTRY}}
GREETING = {
    "type": "function",
    "function": {
        "name": "greet",
        "parameters": {"type": "object", "properties": {"polite": {"type": "boolean"}}, "required": ["polite"]},
    },
}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(
        ["--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--dtype", "float32", "--quantization", "none",
         "--enable-auto-tool-choice", "--tool-call-parser", "word_calls", "--tool-parser-plugin", PLUGINS]
    )  # fmt: skip
    proc.start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, stream: bool = False, **kwargs):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=kwargs.pop("messages", QUESTION),
        max_tokens=kwargs.pop("max_tokens", 16), temperature=0, stream=stream, **kwargs,
    )  # fmt: skip


def merged(chunks) -> dict:
    """The streamed chunks of one choice joined as the client would: texts appended, calls by index."""
    out: dict = {"content": "", "calls": {}, "finish_reason": None}
    for chunk in chunks:
        for choice in chunk.choices:
            out["content"] += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = out["calls"].setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_auto_reads_calls_whole_and_streamed_alike(client):
    # greedy on this server's float32 path does not depend on the batch: the two are sent together
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(ask, client, tools=[CAPITAL])
        streamed = pool.submit(lambda: merged(ask(client, stream=True, tools=[CAPITAL])))
        whole, streamed = whole.result().choices[0], streamed.result()
    assert whole.finish_reason == "tool_calls"
    assert calls_of(whole.message) == [("get_capital", {"city": "France"}), ("get_capital", {"city": "Paris"})]
    assert whole.message.content.startswith("The capital of")
    assert all(c.id.startswith("call_") and c.type == "function" for c in whole.message.tool_calls)
    assert streamed["content"] == whole.message.content
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed["calls"].items())] == calls_of(whole.message)
    assert streamed["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    message = ask(client, tools=[CAPITAL], parallel_tool_calls=False).choices[0].message
    assert calls_of(message) == [("get_capital", {"city": "France"})]


def test_tool_choice_none_renders_the_tools_but_parses_nothing(client):
    with ThreadPoolExecutor(2) as pool:  # sent together, so that the server batches them
        plain = pool.submit(ask, client)
        none = pool.submit(ask, client, tools=[CAPITAL], tool_choice="none")
        plain, none = plain.result(), none.result()
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    assert "France" in none.choices[0].message.content
    # the tools were in the prompt (the Hermes system text)
    assert none.usage.prompt_tokens > plain.usage.prompt_tokens + 50


def test_required_is_forced_by_the_grammar(client):
    def run(parallel: bool):
        return ask(client, tools=[CAPITAL, GREETING], tool_choice="required", parallel_tool_calls=parallel, max_tokens=60).choices[0]

    with ThreadPoolExecutor(2) as pool:  # sent together, so that the server batches them
        choices = list(pool.map(run, (True, False)))
    for parallel, choice in zip((True, False), choices, strict=True):
        assert choice.finish_reason == "tool_calls", choice
        calls = calls_of(choice.message)
        assert calls and (parallel or len(calls) == 1)
        for name, arguments in calls:
            tool = {"get_capital": CAPITAL, "greet": GREETING}[name]
            jsonschema.validate(arguments, tool["function"]["parameters"])


def test_named_function_is_forced_whole_and_streamed_alike(client):
    choice = {"type": "function", "function": {"name": "get_capital"}}
    kwargs = {"tools": [GREETING, CAPITAL], "tool_choice": choice, "max_tokens": 30}
    # greedy on this server's float32 path does not depend on the batch: the two are sent together
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(ask, client, **kwargs)
        streamed = pool.submit(lambda: merged(ask(client, stream=True, **kwargs)))
        whole, streamed = whole.result().choices[0], streamed.result()
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [(name, arguments)] = calls_of(whole.message)
    assert name == "get_capital"
    jsonschema.validate(arguments, COUNTRY)
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        ("get_capital", whole.message.tool_calls[0].function.arguments)
    ]
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == ""


def test_a_conversation_with_calls_and_results_is_accepted(client):
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_capital", "arguments": '{"country": "France"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Paris"},
    ]  # fmt: skip
    r = ask(client, messages=messages, tools=[CAPITAL], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [CAPITAL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
        ({"store": True}, "store"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
    ],
)
def test_refusals_name_the_field(server, fields, param):
    body = {"messages": QUESTION, "max_tokens": 2, **fields}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_off_values_and_labels_are_accepted_and_unknown_fields_logged_once(server):
    url = f"{server.base_url}/v1/chat/completions"
    body = {"messages": QUESTION, "max_tokens": 2, "store": False, "modalities": ["text"], "metadata": {"k": "v"}}
    assert httpx.post(url, json=body, timeout=60).status_code == 200
    for _ in range(2):
        assert httpx.post(url, json={**body, "frobnicate_level": 3}, timeout=60).status_code == 200
    completion = {"prompt": "Hi", "max_tokens": 2, "frobnicate_level": 3}
    assert httpx.post(f"{server.base_url}/v1/completions", json=completion, timeout=60).status_code == 200
    log = server.log_tail(200_000)
    assert log.count("/v1/chat/completions: ignoring the request field 'frobnicate_level'") == 1, log[-2000:]
    assert log.count("/v1/completions: ignoring the request field 'frobnicate_level'") == 1
    assert "'metadata'" not in log


def test_langchain_bind_tools_and_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    llm = langchain_openai.ChatOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", model=httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"],
        temperature=0, max_tokens=40, max_retries=0,
    )  # fmt: skip

    class Country(BaseModel):
        """A country."""

        country: str = Field(json_schema_extra={"enum": ["France", "Spain"]})

    with ThreadPoolExecutor(2) as pool:  # sent together, so that the server batches them
        reply = pool.submit(llm.bind_tools([CAPITAL], tool_choice="get_capital").invoke, "What is the capital of France?")
        result = pool.submit(llm.with_structured_output(Country, method="function_calling").invoke, "Which country has Paris?")
        reply, result = reply.result(), result.result()
    assert [c["name"] for c in reply.tool_calls] == ["get_capital"]
    jsonschema.validate(reply.tool_calls[0]["args"], COUNTRY)
    assert isinstance(result, Country) and result.country in ("France", "Spain")

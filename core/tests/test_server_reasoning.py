"""``--reasoning-parser`` through the real server with the official ``openai`` client: the reply's
thinking comes back as ``reasoning_content`` (streamed before the content), an output constraint applies
only after the thinking, and a server without ``--enable-auto-tool-choice`` refuses tools with an
implicit ``auto`` choice.

The embedded SmolLM2 does not think, so the test-only ``until_is`` parser (``chat_parser_plugins.py``)
takes its greedy answer's words before " is" as the thinking.
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

PLUGINS = os.path.join(os.path.dirname(__file__), "chat_parser_plugins.py")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CAPITAL = {
    "type": "function",
    "function": {
        "name": "get_capital",
        "parameters": {"type": "object", "properties": {"country": {"type": "string", "enum": ["France", "Spain"]}}, "required": ["country"]},
    },
}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(
        ["--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--dtype", "float32", "--quantization", "none",
         "--reasoning-parser", "until_is", "--reasoning-parser-plugin", PLUGINS,
         "--tool-call-parser", "word_calls", "--tool-parser-plugin", PLUGINS]
    )  # fmt: skip
    proc.start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, stream: bool = False, **kwargs):
    model = client.models.list().data[0].id
    kwargs.setdefault("max_tokens", 16)
    return client.chat.completions.create(model=model, messages=QUESTION, temperature=0, stream=stream, **kwargs)


def test_reasoning_content_whole_and_streamed(client):
    # greedy on this server's float32 path does not depend on the batch: the two are sent together
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(ask, client)
        chunks = pool.submit(lambda: list(ask(client, stream=True)))
        message, chunks = whole.result().choices[0].message, chunks.result()
    assert message.reasoning_content == "The capital of France"
    assert message.content == "Paris."
    fields = [(k, v) for c in chunks for ch in c.choices for k, v in ch.delta.model_dump(exclude_none=True).items()
              if k in ("reasoning_content", "content") and v]  # fmt: skip
    kinds = [k for k, _ in fields]
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning_content")
    assert "".join(v for k, v in fields if k == "reasoning_content") == message.reasoning_content
    assert "".join(v for k, v in fields if k == "content") == message.content
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["stop"]


def test_chat_template_kwargs_are_accepted(client):
    message = ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.content == "Paris."  # SmolLM2's template reads no variable: the same prompt


def test_auto_tool_choice_needs_the_server_option(server):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": QUESTION, "tools": [CAPITAL]}, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]


def test_tool_choice_none_keeps_the_reasoning_split(client):
    message = ask(client, tools=[CAPITAL], tool_choice="none").choices[0].message
    assert message.tool_calls is None and message.reasoning_content and message.content


def test_a_forced_call_has_no_reasoning(client):
    choice = {"type": "function", "function": {"name": "get_capital"}}
    reply = ask(client, tools=[CAPITAL], tool_choice=choice, max_tokens=30).choices[0]
    assert reply.finish_reason == "tool_calls"
    assert reply.message.tool_calls[0].function.name == "get_capital"
    assert getattr(reply.message, "reasoning_content", None) is None


def test_constraint_applies_after_the_thinking(client):
    """The thinking stays free text; the JSON schema constrains only the answer after it (this server's
    ``word_calls`` tool parser reads nothing here: the requests carry no tools)."""
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    # greedy on this server's float32 path does not depend on the batch: the two are sent together
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(ask, client, response_format=fmt, max_tokens=120)
        chunks = pool.submit(lambda: list(ask(client, stream=True, response_format=fmt, max_tokens=120)))
        message, chunks = whole.result().choices[0].message, chunks.result()
    assert message.reasoning_content == "The capital of France"  # free text, as without a constraint
    assert json.loads(message.content) == {"city": "Paris"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content

"""Output constraints through the real server with the official ``openai`` client, on the embedded
SmolLM2: ``response_format``, ``structured_outputs``, the ``guided_*`` names, their refusals, the
clients' own structured-output helpers, and a constraint that waits for a reasoning parser's thinking.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from engine.entrypoints.openai.launcher import ServerProcess

pytestmark = pytest.mark.slow

jsonschema = pytest.importorskip("jsonschema")

PLUGINS = os.path.join(os.path.dirname(__file__), "chat_parser_plugins.py")
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
SERVER_ARGS = [
    "--kv-cache-memory",
    "256MiB",
    "--max-model-len",
    "1024",
    "--dtype",
    "float32",
    "--quantization",
    "none",
]
#: bounded so that even a sampled answer ends well within max_tokens
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["person", "active"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum_and_pattern": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        },
        "required": ["color", "code"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "any_of_and_ranges": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 6}]
            },
            "count": {"type": "integer", "minimum": 10, "maximum": 20},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["value", "count", "ratio"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(SERVER_ARGS)
    proc.start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat(client, model, stream: bool = False, **kwargs):
    kwargs.setdefault("max_tokens", 120)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=model, messages=kwargs.pop("messages", ASK), stream=stream, **kwargs
    )


def streamed_text(chunks) -> tuple[str, str | None]:
    """A streamed choice's content, joined, and its finish reason."""
    text, reason = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            text += (choice.delta.content if hasattr(choice, "delta") else choice.text) or ""
            reason = choice.finish_reason or reason
    return text, reason


def test_json_schemas_greedy_and_sampled(client, model):
    cases = [
        (name, sampling)
        for name in SCHEMAS
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 7})
    ]

    def run(case):
        name, sampling = case
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        return chat(client, model, response_format=fmt, **sampling).choices[0]

    # sent together, so that the server batches them
    with ThreadPoolExecutor(len(cases)) as pool:
        for (name, sampling), choice in zip(cases, pool.map(run, cases), strict=True):
            assert choice.finish_reason == "stop", (name, sampling, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object_and_strict_false_and_completions(client, model):
    # any JSON object: the tiny model may not close it within max_tokens, but it starts as one
    for extra in (
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json_object": True}},
    ):
        choice = chat(client, model, extra_body=extra, max_tokens=40).choices[0]
        text = choice.message.content
        assert (
            isinstance(json.loads(text), dict) if choice.finish_reason == "stop" else text.startswith("{")
        ), text
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["refs"], "strict": False}}
    jsonschema.validate(
        json.loads(chat(client, model, response_format=fmt).choices[0].message.content), SCHEMAS["refs"]
    )
    text = chat(client, model, response_format={"type": "text"}, max_tokens=4).choices[0].message.content
    assert text  # plain text: no constraint
    done = client.completions.create(
        model=model, prompt="A point:", max_tokens=60, temperature=0, extra_body={"response_format": fmt}
    )
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMAS["refs"])


def test_regex_choice_grammar_and_guided_aliases(client, model):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    ebnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    choices = ["Paris", "London", "Rome"]
    cases = [
        ({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t)),
        ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
        ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
        ({"guided_choice": choices, "guided_decoding_backend": "xgrammar"}, lambda t: t in choices),
        ({"structured_outputs": {"grammar": ebnf}}, lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
        ({"guided_grammar": ebnf, "guided_decoding_backend": "auto"}, lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
        ({"guided_json": SCHEMAS["array"]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["array"]) is None),
        ({"guided_json": json.dumps(SCHEMAS["array"])}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["array"]) is None),
        ({"structured_outputs": {"json": SCHEMAS["array"], "disable_any_whitespace": False}}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["array"]) is None),
    ]  # fmt: skip
    runs = [(extra, check, temperature) for extra, check in cases for temperature in (0, 0.8)]

    def run(case):
        extra, _, temperature = case
        return chat(client, model, extra_body=extra, temperature=temperature, seed=3, max_tokens=60).choices[
            0
        ]

    with ThreadPoolExecutor(len(runs)) as pool:
        for (extra, check, _), choice in zip(runs, pool.map(run, runs), strict=True):
            assert choice.finish_reason == "stop" and check(choice.message.content), (
                extra,
                choice.message.content,
            )
    done = client.completions.create(
        model=model,
        prompt="The capital of Italy is",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": choices},
    )
    assert done.choices[0].text in choices


def test_streaming_equals_whole(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}
    whole = chat(client, model, response_format=fmt).choices[0]
    text, reason = streamed_text(chat(client, model, stream=True, response_format=fmt))
    assert (text, reason) == (whole.message.content, whole.finish_reason)
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])
    regex = {"guided_regex": r"(ab|cd){2,5}!"}
    kwargs = {"model": model, "prompt": "Letters:", "max_tokens": 30, "temperature": 0, "extra_body": regex}
    whole_text = client.completions.create(**kwargs).choices[0].text
    assert streamed_text(client.completions.create(stream=True, **kwargs)) == (whole_text, "stop")
    assert re.fullmatch(r"(ab|cd){2,5}!", whole_text)


WEATHER = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format", ["guided_regex"]),
        ({"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]}, "structured_outputs", ["guided_choice"]),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", ["regex", "choice"]),
        ({"structured_outputs": {}}, "structured_outputs", ["exactly one"]),
        ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs", []),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", ["choice"]),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a+"}, "guided_decoding_backend", ["outlines"]),
        ({"guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern", ["not supported"]),
        ({"response_format": {"type": "xml"}}, "response_format", []),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", ["schema"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format", ["nonsense"]),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json", ["minimum"]),
        ({"guided_json": "{not json"}, "guided_json", ["JSON"]),
        ({"guided_regex": "(unclosed"}, "guided_regex", []),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs", []),
        ({"guided_choice": ["a"], "use_beam_search": True, "n": 2}, "guided_choice", ["beam"]),
        ({"guided_choice": ["a"], "tools": [WEATHER], "tool_choice": "required"}, "tool_choice", []),
        ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice", []),
    ],
)  # fmt: skip
def test_refusals_name_the_field(server, fields, param, words):
    body = {"messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, r.text
    assert all(w.lower() in error["message"].lower() for w in words), error["message"]


def test_completion_refusals_and_the_server_stays_healthy(server, client, model):
    url = f"{server.base_url}/v1/completions"
    for fields, param in [
        ({"guided_regex": "(("}, "guided_regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format",
        ),
    ]:
        r = httpx.post(url, json={"prompt": "Hi", "max_tokens": 4, **fields}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    assert chat(client, model, max_tokens=3).choices[0].finish_reason == "length"
    log = server.log_tail(200_000)
    for name in (
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_decoding_backend",
    ):
        assert f"ignoring the request field '{name}'" not in log


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


def test_openai_parse_helper(client, model):
    completions = (
        client.chat.completions if hasattr(client.chat.completions, "parse") else client.beta.chat.completions
    )
    reply = completions.parse(model=model, messages=ASK, response_format=Person, max_tokens=60, temperature=0)
    assert isinstance(reply.choices[0].message.parsed, Person)


def test_langchain_structured_output(server, model):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        model=model,
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    person = llm.with_structured_output(Person, method="json_schema").invoke("Describe a person.")
    assert isinstance(person, Person)
    # json_mode constrains to some JSON object only: the prompt names the keys
    person = llm.with_structured_output(Person, method="json_mode").invoke(
        "Give a person's name and age as JSON."
    )
    assert isinstance(person, Person)


@pytest.fixture(scope="module")
def thinking_server():
    """A server whose test-only ``until_is`` parser reads the greedy answer's words before " is" as thinking."""
    proc = ServerProcess(
        [*SERVER_ARGS, "--reasoning-parser", "until_is", "--reasoning-parser-plugin", PLUGINS]
    )
    proc.start()
    yield proc
    proc.close()


def test_constraint_applies_after_the_thinking(thinking_server):
    client = openai.OpenAI(
        base_url=f"{thinking_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    model = client.models.list().data[0].id
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    question = [{"role": "user", "content": "What is the capital of France?"}]
    message = chat(client, model, messages=question, response_format=fmt).choices[0].message
    assert message.reasoning_content == "The capital of France"  # free text, as without a constraint
    assert json.loads(message.content) == {"city": "Paris"}
    chunks = list(chat(client, model, stream=True, messages=question, response_format=fmt))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content

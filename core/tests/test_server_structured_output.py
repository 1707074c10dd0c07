"""Output constraints through the real server with the official ``openai`` client, on the embedded
SmolLM2: ``response_format``, ``structured_outputs``, the ``guided_*`` names, their refusals and the
clients' own structured-output helpers. A constraint that waits for a reasoning parser's thinking is
checked in ``test_server_reasoning.py``, on that module's server with the reasoning parser.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pydantic import BaseModel, Field

from engine.entrypoints.openai.launcher import ServerProcess
from engine_test_utils import unpooled_openai_client

pytestmark = pytest.mark.slow

jsonschema = pytest.importorskip("jsonschema")

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
    return unpooled_openai_client(f"{server.base_url}/v1")


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
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["refs"], "strict": False}}
    requests = [
        lambda: chat(client, model, extra_body={"response_format": {"type": "json_object"}}, max_tokens=40),
        lambda: chat(client, model, extra_body={"structured_outputs": {"json_object": True}}, max_tokens=40),
        lambda: chat(client, model, response_format=fmt),
        lambda: chat(client, model, response_format={"type": "text"}, max_tokens=4),
        lambda: client.completions.create(
            model=model, prompt="A point:", max_tokens=60, temperature=0, extra_body={"response_format": fmt}
        ),
    ]
    # sent together, so that the server batches them
    with ThreadPoolExecutor(len(requests)) as pool:
        json_object, structured_json_object, strict_false, plain, done = pool.map(
            lambda send: send(), requests
        )
    # any JSON object: the tiny model may not close it within max_tokens, but it starts as one
    for choice in (json_object.choices[0], structured_json_object.choices[0]):
        text = choice.message.content
        assert (
            isinstance(json.loads(text), dict) if choice.finish_reason == "stop" else text.startswith("{")
        ), text
    jsonschema.validate(json.loads(strict_false.choices[0].message.content), SCHEMAS["refs"])
    assert plain.choices[0].message.content  # plain text: no constraint
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

    def complete():
        return client.completions.create(
            model=model,
            prompt="The capital of Italy is",
            max_tokens=10,
            temperature=0,
            extra_body={"guided_choice": choices},
        )

    # sent together (the completion too), so that the server batches them
    with ThreadPoolExecutor(len(runs) + 1) as pool:
        done = pool.submit(complete)
        for (extra, check, _), choice in zip(runs, pool.map(run, runs), strict=True):
            assert choice.finish_reason == "stop" and check(choice.message.content), (
                extra,
                choice.message.content,
            )
        assert done.result().choices[0].text in choices


def test_streaming_equals_whole(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}
    regex = {"guided_regex": r"(ab|cd){2,5}!"}
    kwargs = {"model": model, "prompt": "Letters:", "max_tokens": 30, "temperature": 0, "extra_body": regex}
    # greedy on this server's float32 path does not depend on the batch: the four are sent together
    with ThreadPoolExecutor(4) as pool:
        whole = pool.submit(chat, client, model, response_format=fmt)
        streamed = pool.submit(lambda: streamed_text(chat(client, model, stream=True, response_format=fmt)))
        whole_completion = pool.submit(client.completions.create, **kwargs)
        streamed_completion = pool.submit(
            lambda: streamed_text(client.completions.create(stream=True, **kwargs))
        )
        whole, (text, reason) = whole.result().choices[0], streamed.result()
        whole_text = whole_completion.result().choices[0].text
        assert streamed_completion.result() == (whole_text, "stop")
    assert (text, reason) == (whole.message.content, whole.finish_reason)
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])
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
    # json_mode constrains to some JSON object only: the prompt names the keys
    asks = [("json_schema", "Describe a person."), ("json_mode", "Give a person's name and age as JSON.")]
    with ThreadPoolExecutor(len(asks)) as pool:  # sent together, so that the server batches them
        people = list(
            pool.map(lambda ask: llm.with_structured_output(Person, method=ask[0]).invoke(ask[1]), asks)
        )
    assert all(isinstance(person, Person) for person in people), people

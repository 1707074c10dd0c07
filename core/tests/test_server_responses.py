"""OpenAI's Responses API (stateless) with the ``openai`` client, in process on a tiny random Llama:
create, stream, instructions and message lists, a named function tool and its output sent back, a JSON
schema text format, and the refusals of what a stateless server cannot do."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient
from test_server_routes import tiny_engine

from engine.entrypoints.openai.server import build_app

WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]},
}  # fmt: skip


@pytest.fixture(scope="module")
def http(tiny_llama_dir):
    with TestClient(build_app(tiny_engine(tiny_llama_dir))) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def test_create_and_stream_give_the_same_text(client, model):
    kwargs = dict(model=model, input="Tell me a story", instructions="Be brief.", max_output_tokens=6, temperature=0)
    response = client.responses.create(**kwargs)
    assert response.object == "response" and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 6 and response.output_text
    # as OpenAI's API does, a response cut by max_output_tokens ends with response.incomplete (which the
    # client's get_final_response does not take: the last event carries the response)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert events[-1].response.output_text == response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_message_lists_and_a_named_function_call_round_trip(client, model):
    turns = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
    named = dict(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40, temperature=0)
    response = client.responses.create(model=model, input=turns, **named)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    followup = client.responses.create(
        model=model, tools=[WEATHER], tool_choice="none", max_output_tokens=3,
        input=[*turns, {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}],
    )  # fmt: skip
    assert followup.usage.input_tokens > response.usage.input_tokens
    events = list(client.responses.create(model=model, input=turns, stream=True, **named))
    assert "response.function_call_arguments.delta" in [event.type for event in events]
    final = events[-1].response
    assert final.status == "completed" and [item.type for item in final.output] == ["function_call"]
    assert json.loads(final.output[0].arguments) == json.loads(calls[0].arguments)


def test_a_json_schema_text_format_constrains_the_output(client, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    response = client.responses.create(
        model=model, input="Answer", max_output_tokens=20,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert isinstance(json.loads(response.output_text)["ok"], bool)


def test_what_a_stateless_server_cannot_do_is_refused(client, model):
    for kwargs, field in ((dict(store=True), "store"), (dict(previous_response_id="resp_1"), "previous_response_id")):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=model, input="x", max_output_tokens=2, **kwargs)
        assert info.value.body["param"] == field
    with pytest.raises(openai.BadRequestError, match="reasoning"):
        client.responses.create(model=model, input="x", max_output_tokens=2, reasoning={"effort": "low"})

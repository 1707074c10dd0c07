"""Anthropic's Messages API with the official ``anthropic`` client (whose newest versions no longer take
sampling settings as arguments: they go in ``extra_body``, as older clients send them), in process on a tiny random Llama:
create, stream, a named tool (no tool parser needed), tool results in the conversation, count_tokens,
stop sequences and Anthropic-shaped errors."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_server_routes import tiny_engine

from engine.entrypoints.openai.server import build_app

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def http(tiny_llama_dir):
    with TestClient(build_app(tiny_engine(tiny_llama_dir))) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    import anthropic  # here, not at the top: importing it takes 2 s, which each test worker's collection would pay

    return anthropic.Anthropic(base_url=str(http.base_url), api_key="unused", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def test_create_answers_a_message_with_usage(client, model, http):
    message = client.messages.create(
        model=model, max_tokens=5, system="You are terse.", extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Bye"}],
    )  # fmt: skip
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    assert message.content[0].type == "text" and message.content[0].text
    counted = client.messages.count_tokens(
        model=model, system="You are terse.",
        messages=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Bye"}],
    )  # fmt: skip
    assert counted.input_tokens == message.usage.input_tokens


def test_stream_gives_the_event_sequence_and_the_same_text(client, model):
    kwargs = dict(model=model, max_tokens=6, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Tell me a story"}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_delta" in events and "message_delta" in events
    assert final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == 6 and final.stop_reason == "max_tokens"


def test_a_named_tool_is_called_with_schema_valid_input_and_its_result_goes_back(client, model):
    message = client.messages.create(
        model=model, max_tokens=40, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )  # fmt: skip
    calls = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(calls) == 1
    assert calls[0].name == "get_weather" and isinstance(calls[0].input.get("city"), str)
    # without a tool parser the server takes no "auto" choice (a one-line 400 says so): the answer is text
    followup = client.messages.create(
        model=model, max_tokens=3, tools=[WEATHER], tool_choice={"type": "none"},
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": message.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"}]},
        ],
    )  # fmt: skip
    assert followup.usage.input_tokens > message.usage.input_tokens


def test_streamed_tool_call_arrives_as_input_json_deltas(client, model):
    with client.messages.stream(
        model=model, max_tokens=40, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    calls = [block for block in final.content if block.type == "tool_use"]
    assert final.stop_reason == "tool_use" and isinstance(calls[0].input.get("city"), str)


def test_stop_sequences_report_the_one_matched(client, model):
    whole = client.messages.create(model=model, max_tokens=12, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Count"}])
    text = whole.content[0].text
    stop = text.strip()[2:5] if len(text.strip()) > 5 else None
    if not stop:
        pytest.skip("the tiny model's reply is too short to cut")
    cut = client.messages.create(model=model, max_tokens=12, extra_body={"temperature": 0}, stop_sequences=[stop], messages=[{"role": "user", "content": "Count"}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert stop not in cut.content[0].text


def test_errors_take_anthropics_shape(client, model, http):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "x"}], extra_body={"frobnicate": 1})
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert "frobnicate" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    response = http.post("/v1/messages", json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert response.status_code == 400 and response.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "x"}], thinking={"type": "enabled", "budget_tokens": 1024})

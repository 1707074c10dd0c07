"""The app on a tiny random Llama, in process: /ping, GET /v1/models/{id}, the access log, content parts the
model cannot take, and the served name of a user-given model."""

from __future__ import annotations

import logging
import os
import re

import pytest
from fastapi.testclient import TestClient

from engine import LLM
from engine.async_engine import AsyncLLMEngine
from engine.entrypoints.openai.access_log import RequestUsage, format_line
from engine.entrypoints.openai.server import build_app
from engine.loader.paths import DEFAULT_MODEL_NAME, default_served_name

ACCESS_LINE = re.compile(
    r'^\S+ "(?P<method>[A-Z]+) (?P<path>\S+)" (?P<status>\d{3}) '
    r"prompt_tokens=(?P<prompt>\d+|-) completion_tokens=(?P<completion>\d+|-) (?P<seconds>\d+\.\d{3})s$"
)
QUESTION = [{"role": "user", "content": "Hello there"}]


def tiny_engine(path: str) -> AsyncLLMEngine:
    """A fresh engine: an app's shutdown stops its engine for good, so every app gets its own."""
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    return AsyncLLMEngine(llm.llm_engine)


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    with TestClient(build_app(tiny_engine(tiny_llama_dir))) as c:
        yield c


def access_lines(caplog) -> list[dict[str, str]]:
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.access"]
    matches = [ACCESS_LINE.match(line) for line in lines]
    assert all(matches), lines
    return [m.groupdict() for m in matches if m]


def test_a_user_given_model_keeps_its_folder_name(client, tiny_llama_dir):
    name = os.path.basename(tiny_llama_dir.rstrip("/"))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [name]
    assert default_served_name(None, "/x/SmolLM2-135M-Instruct.Q4_1.gguf") == DEFAULT_MODEL_NAME
    assert default_served_name("/x/model.gguf", "/x/model.gguf") == "model"


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_like_health(client, method):
    response = client.request(method, "/ping")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_one_model_by_id_in_openai_shape(client):
    name = client.get("/v1/models").json()["data"][0]["id"]
    card = client.get(f"/v1/models/{name}").json()
    assert card["id"] == name and card["object"] == "model" and card["owned_by"] == "engine"
    assert set(card) >= {"id", "object", "created", "owned_by"}


def test_a_hub_style_id_with_a_slash_reaches_the_route(tiny_llama_dir):
    with TestClient(build_app(tiny_engine(tiny_llama_dir), served_model_names=[DEFAULT_MODEL_NAME])) as c:
        assert c.get(f"/v1/models/{DEFAULT_MODEL_NAME}").json()["id"] == DEFAULT_MODEL_NAME


def test_an_unknown_model_id_is_an_openai_404(client):
    response = client.get("/v1/models/gpt-7")
    assert response.status_code == 404
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "model_not_found" and "gpt-7" in error["message"]


def test_one_access_line_per_request_with_its_tokens(client, caplog):
    caplog.set_level(logging.INFO, logger="engine.access")
    reply = client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 5, "temperature": 0}).json()
    with client.stream("POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "stream": True}) as streamed:
        assert streamed.status_code == 200
        streamed.read()
    client.get("/nowhere")
    chat, stream, missing = access_lines(caplog)
    assert (chat["method"], chat["path"], chat["status"]) == ("POST", "/v1/chat/completions", "200")
    assert int(chat["prompt"]) == reply["usage"]["prompt_tokens"]
    assert int(chat["completion"]) == reply["usage"]["completion_tokens"]
    assert (stream["path"], stream["status"], stream["completion"]) == ("/v1/completions", "200", "4")
    assert (missing["path"], missing["status"], missing["prompt"], missing["completion"]) == ("/nowhere", "404", "-", "-")


def test_the_access_log_can_be_turned_off(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="engine.access")
    with TestClient(build_app(tiny_engine(tiny_llama_dir), access_log=False)) as c:
        assert c.get("/health").status_code == 200
    assert access_lines(caplog) == []


def test_format_line():
    line = format_line("127.0.0.1:5000", "POST", "/v1/completions", 200, RequestUsage(5, 16), 0.4123)
    assert line == '127.0.0.1:5000 "POST /v1/completions" 200 prompt_tokens=5 completion_tokens=16 0.412s'


@pytest.mark.parametrize(
    "part,kind",
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "images"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
        ({"type": "file", "file": {"file_id": "f"}}, "files"),
    ],
)
def test_a_part_the_model_cannot_take_is_refused_by_name(client, part, kind):
    content = [{"type": "text", "text": "What is this?"}, part]
    for route in ("/v1/chat/completions", "/tokenize"):
        response = client.post(route, json={"messages": [{"role": "user", "content": content}]})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["message"] == f"messages[0].content[1]: this model does not accept {kind} (it accepts: text)"
        assert error["param"] == "messages"


def test_text_parts_still_work(client):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    body = {"max_tokens": 3, "temperature": 0}
    as_parts = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}], **body})
    as_text = client.post("/v1/chat/completions", json={"messages": QUESTION, **body})
    assert as_parts.status_code == 200, as_parts.text
    assert as_parts.json()["choices"][0]["message"] == as_text.json()["choices"][0]["message"]


def test_stream_interval_sends_fewer_larger_chunks_with_the_same_text(tiny_llama_dir):
    import json

    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(AsyncLLMEngine(llm.llm_engine, stream_interval=3), served_model_names=["tiny-llama"])) as c:
        whole = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    texts = [ch["text"] for ch in choices if ch["text"]]
    # outputs after 1, 4, 7 and 10 tokens: at most four chunks of text, then the finish
    assert 1 <= len(texts) <= 4 and "".join(texts) == whole
    assert choices[-1]["finish_reason"] == "length"

"""The request fields users of the leading engines send, each honoured: allowed_token_ids, bad_words,
priority, request_id and X-Request-Id, truncate_prompt_tokens, return_token_ids, cached tokens in usage,
stop_reason; in process on a tiny random Llama."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_server_routes import tiny_engine

from engine import LLM, SamplingParams
from engine.entrypoints.openai.server import build_app

PROMPT = [1, 504, 3458, 282, 4649, 314, 2060, 28, 216]


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    with TestClient(build_app(tiny_engine(tiny_llama_dir))) as c:
        yield c


def _complete(client, **fields) -> dict:
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_allowed_token_ids_limit_every_sampled_token(client):
    allowed = [17, 42, 1000]
    for temperature in (0, 1.0):
        data = _complete(client, allowed_token_ids=allowed, return_token_ids=True, temperature=temperature, seed=3)
        assert set(data["choices"][0]["token_ids"]) <= set(allowed)
    response = client.post("/v1/completions", json={"prompt": PROMPT, "allowed_token_ids": [10**9]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_never_appear(client):
    greedy = _complete(client, return_token_ids=True)["choices"][0]
    first_word = greedy["text"].split()[0] if greedy["text"].split() else None
    if not first_word:
        pytest.skip("the tiny model's greedy text has no word to ban")
    banned = _complete(client, bad_words=[first_word], max_tokens=12)["choices"][0]
    assert first_word not in banned["text"].split()


def test_request_id_names_the_response_and_x_request_id_is_echoed(client):
    response = client.post(
        "/v1/chat/completions", headers={"X-Request-Id": "trace-77"},
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "request_id": "abc"},
    )  # fmt: skip
    assert response.status_code == 200
    assert response.json()["id"] == "chatcmpl-abc" and response.headers["x-request-id"] == "trace-77"
    # the same request_id twice at once is fine: the engine's own ids stay unique
    again = _complete(client, request_id="abc")
    assert again["id"] == "cmpl-abc"
    bad = client.post("/v1/completions", headers={"X-Request-Id": "x"}, json={"prompt": PROMPT, "max_tokens": -1})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "x"


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    whole = _complete(client, prompt=PROMPT[-4:])
    cut = _complete(client, truncate_prompt_tokens=4, return_token_ids=True)
    assert cut["usage"]["prompt_tokens"] == 4 and cut["choices"][0]["prompt_token_ids"] == PROMPT[-4:]
    assert cut["choices"][0]["text"] == whole["choices"][0]["text"]


def test_cached_tokens_and_priority(client):
    long_prompt = PROMPT * 4
    first = _complete(client, prompt=long_prompt)
    second = _complete(client, prompt=long_prompt, priority=-5)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_stop_reason_names_the_stop_string(client):
    text = _complete(client, max_tokens=10)["choices"][0]["text"]
    if len(text.strip()) < 4:
        pytest.skip("the tiny model's greedy text is too short to cut")
    stop = text.strip()[1:3]
    choice = _complete(client, max_tokens=10, stop=[stop])["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def test_sampling_params_take_the_same_fields_offline(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=5, allowed_token_ids=[5, 6]), use_tqdm=False)[0]
    assert set(out.outputs[0].token_ids) <= {5, 6}

"""Malformed and hostile requests against the real server: each gets a 4xx in OpenAI's error JSON, and the
server keeps serving with every KV block free. Also the API key and the waiting-queue limit."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from engine.entrypoints.openai.launcher import ServerProcess

pytestmark = pytest.mark.slow

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSGS = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(
        ["--api-key", KEY, "--max-model-len", "256", "--kv-cache-memory", "64MiB", "--max-num-seqs", "1",
         "--max-waiting-requests", "1", "--served-model-name", "smol"]
    )
    proc.start()
    yield proc
    proc.close()


def post(server, path: str, body: bytes | dict | list | None = None, headers: dict | None = None) -> httpx.Response:
    headers = {**AUTH, **(headers or {})}
    if isinstance(body, bytes):
        return httpx.post(server.base_url + path, content=body, headers={"Content-Type": "application/json", **headers}, timeout=60)
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def assert_openai_error(response: httpx.Response, status: int | tuple[int, ...]) -> dict:
    statuses = status if isinstance(status, tuple) else (status,)
    assert response.status_code in statuses, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"]
    assert isinstance(error["type"], str)
    return error


HOSTILE: list[tuple[str, str, bytes | dict | list | None, int, str | None]] = [
    ("broken json", CHAT, b'{"messages": [{"role": "user", "content": "hi"}', 400, None),
    ("empty body", CHAT, b"", 400, None),
    ("json array body", CHAT, [1, 2, 3], 400, None),
    ("json null body", CHAT, b"null", 400, None),
    ("invalid utf-8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe\xfd"}]}', 400, None),
    ("deeply nested json", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("missing messages", CHAT, {"max_tokens": 4}, 400, "messages"),
    ("messages not a list", CHAT, {"messages": "hello"}, 400, "messages"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("content not text", CHAT, {"messages": [{"role": "user", "content": 42}]}, 400, "messages"),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("max_tokens as string", CHAT, {"messages": MSGS, "max_tokens": "ten"}, 400, "max_tokens"),
    ("temperature as string", CHAT, {"messages": MSGS, "temperature": "hot"}, 400, "temperature"),
    ("stream as string", CHAT, {"messages": MSGS, "stream": "yes"}, 400, "stream"),
    ("seed as string", CHAT, {"messages": MSGS, "seed": "abc"}, 400, "seed"),
    ("huge max_tokens", CHAT, {"messages": MSGS, "max_tokens": 10**12}, 400, "max_completion_tokens"),
    ("zero max_tokens", CHAT, {"messages": MSGS, "max_tokens": 0}, 400, "max_tokens"),
    ("negative n", CHAT, {"messages": MSGS, "n": -1}, 400, "n"),
    ("n too large", CHAT, {"messages": MSGS, "n": 100_000}, 400, "n"),
    ("negative temperature", CHAT, {"messages": MSGS, "temperature": -1}, 400, "temperature"),
    ("top_p zero", CHAT, {"messages": MSGS, "top_p": 0}, 400, "top_p"),
    ("presence_penalty out of range", CHAT, {"messages": MSGS, "presence_penalty": 5}, 400, "presence_penalty"),
    ("top_logprobs too large", CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    ("logit_bias non-numeric key", CHAT, {"messages": MSGS, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias out of vocab", CHAT, {"messages": MSGS, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("logit_bias value out of range", CHAT, {"messages": MSGS, "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("empty stop string", CHAT, {"messages": MSGS, "stop": [""]}, 400, "stop"),
    ("too many stop strings", CHAT, {"messages": MSGS, "stop": [f"s{i}" for i in range(100)]}, 400, "stop"),
    ("min_tokens over max_tokens", CHAT, {"messages": MSGS, "max_tokens": 2, "min_tokens": 5}, 400, None),
    ("negative top_k", CHAT, {"messages": MSGS, "top_k": -5}, 400, "top_k"),
    ("unknown model", CHAT, {"model": "gpt-7", "messages": MSGS}, 404, "model"),
    ("prompt over the context", COMP, {"prompt": "word " * 400, "max_tokens": 4}, 400, None),
    ("prompt plus max_tokens over the context", COMP, {"prompt": "Hello there", "max_tokens": 255}, 400, "max_tokens"),
    ("missing prompt", COMP, {"max_tokens": 4}, 400, "prompt"),
    ("empty prompt", COMP, {"prompt": ""}, 400, "prompt"),
    ("prompt token out of vocab", COMP, {"prompt": [1, 2, 99999999]}, 400, "prompt"),
    ("prompt of wrong type", COMP, {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("completion logprobs too large", COMP, {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("suffix unsupported", COMP, {"prompt": "hi", "suffix": "bye"}, 400, "suffix"),
    ("empty cache_salt", COMP, {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ("empty chat cache_salt", CHAT, {"messages": MSGS, "cache_salt": ""}, 400, "cache_salt"),
    ("cache_salt not a string", CHAT, {"messages": MSGS, "cache_salt": 5}, 400, "cache_salt"),
    ("beam search with an empty cache_salt", COMP, {"prompt": "hi", "n": 2, "use_beam_search": True, "cache_salt": ""}, 400, "cache_salt"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("tokenize with neither prompt nor messages", "/tokenize", {}, 400, None),
]


@pytest.mark.parametrize("name,path,body,status,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_gets_openai_error(server, name, path, body, status, param):
    error = assert_openai_error(post(server, path, body), status)
    if param is not None:
        assert error["param"] == param, error


def test_ten_megabyte_body_is_refused(server):
    body = b'{"messages": [{"role": "user", "content": "' + b"a" * (10 * 1024 * 1024) + b'"}]}'
    assert_openai_error(post(server, CHAT, body), 413)
    # and when the size is not announced up front (chunked upload)
    chunks = iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
    headers = {**AUTH, "Content-Type": "application/json"}
    response = httpx.post(server.base_url + CHAT, content=chunks, headers=headers, timeout=60)
    assert_openai_error(response, 413)


def test_unknown_route_and_wrong_method(server):
    assert_openai_error(httpx.get(server.base_url + "/v1/nothing", headers=AUTH), 404)
    assert_openai_error(httpx.get(server.base_url + CHAT, headers=AUTH), 405)


def test_api_key_is_required(server):
    assert_openai_error(httpx.post(server.base_url + CHAT, json={"messages": MSGS}), 401)
    assert_openai_error(httpx.post(server.base_url + CHAT, json={"messages": MSGS}, headers={"Authorization": "Bearer nope"}), 401)
    assert_openai_error(httpx.get(server.base_url + "/v1/models"), 401)
    assert httpx.get(server.base_url + "/health").status_code == 200  # probes need no key
    ok = post(server, CHAT, {"model": "smol", "messages": MSGS, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["model"] == "smol"


def test_bearer_scheme_is_case_insensitive_and_the_key_is_not(server):
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        response = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=10)
        assert response.status_code == 200, scheme
    for value in (f"Bearer {KEY.upper()}", f"Basic {KEY}", f"Bearer{KEY}", KEY, f"Bearer {KEY}x"):
        assert_openai_error(httpx.get(server.base_url + "/v1/models", headers={"Authorization": value}, timeout=10), 401)


def test_no_cross_origin_access_by_default(server):
    """Without --allowed-origins no response carries CORS headers, so browsers keep other sites' pages out."""
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in httpx.options(server.base_url + CHAT, headers=preflight, timeout=10).headers
    models = httpx.get(server.base_url + "/v1/models", headers={**AUTH, "Origin": "https://evil.example"}, timeout=10)
    assert models.status_code == 200 and "access-control-allow-origin" not in models.headers


def test_queue_full_is_503(server):
    """One sequence may run and one wait: a third request is refused with 503, then all is served again
    (the two streams are closed once the 503 is seen, which aborts them)."""
    long_request = {"prompt": "Tell me a story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client, contextlib.ExitStack() as streams:
        running = streams.enter_context(client.stream("POST", COMP, json=long_request))
        assert running.status_code == 200
        _wait_for(server, lambda h: h["num_requests_in_flight"] == 1 and h["num_steps"] > 0)
        waiting = streams.enter_context(client.stream("POST", COMP, json=long_request))
        assert waiting.status_code == 200
        _wait_for(server, lambda h: h["num_requests_in_flight"] == 2)
        error = assert_openai_error(post(server, COMP, {"prompt": "hi", "max_tokens": 2}), 503)
        assert error["code"] == "queue_full"
    _wait_for(server, lambda h: h["num_requests_in_flight"] == 0)
    ok = post(server, COMP, {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_server_still_healthy_with_every_block_free(server):
    ok = post(server, CHAT, {"messages": MSGS, "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] > 0
    h = _wait_for(server, lambda h: h["num_requests_in_flight"] == 0)
    assert h["status"] == "ok"
    assert h["num_free_blocks"] == h["num_total_blocks"] > 0


def _wait_for(server, predicate, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        h = httpx.get(server.base_url + "/health", timeout=10).json()
        if predicate(h):
            return h
        assert time.monotonic() < deadline, f"timed out waiting; last health: {h}"
        time.sleep(0.05)

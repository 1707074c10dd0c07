"""Who may call the server and how much one request may ask for, through the real server process: JSON
bodies only, the Host check against DNS rebinding, CORS, the waiting-queue admission of every request
kind, and the per-request limits."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from engine.entrypoints.openai.launcher import ServerProcess

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "Hello"}]
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server():
    # no API key on a loopback address: the Host check is on by default
    proc = ServerProcess(
        ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--max-num-seqs", "1", "--max-waiting-requests", "3",
         "--max-n", "4", "--max-prompts-per-request", "3", "--max-tokens-per-request", "600", "--allowed-origins", ORIGIN]
    )  # fmt: skip
    proc.start()
    yield proc
    proc.close()


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> str:
    """Check OpenAI's error shape; returns the message."""
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


def test_json_routes_refuse_bodies_not_sent_as_json(server):
    """A page can make a browser post text/plain or a form anywhere without a preflight; none is accepted."""
    bodies = {COMP: b'{"prompt": "hi", "max_tokens": 1}', CHAT: b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}',
              "/tokenize": b'{"prompt": "hi"}', "/detokenize": b'{"tokens": [1]}'}  # fmt: skip
    for path, body in bodies.items():
        for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                             "multipart/form-data; boundary=x", None):  # fmt: skip
            headers = {"Content-Type": content_type} if content_type else {}
            response = httpx.post(server.base_url + path, content=body, headers=headers, timeout=30)
            assert_error(response, 415, code="unsupported_media_type")
        for content_type in ("application/json; charset=utf-8", "Application/JSON"):
            response = httpx.post(server.base_url + path, content=body, headers={"Content-Type": content_type}, timeout=60)
            assert response.status_code == 200, (path, content_type, response.text)


def test_host_header_must_name_this_machine(server):
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 still sends Host: evil.example."""
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example", "localhost.evil.example"):
        for path in ("/health", "/v1/models"):
            assert_error(httpx.get(server.base_url + path, headers={"Host": host}, timeout=10), 400, code="invalid_host")
        response = httpx.post(server.base_url + COMP, json={"prompt": "hi", "max_tokens": 1}, headers={"Host": host}, timeout=10)
        assert_error(response, 400, code="invalid_host")
    for host in (f"127.0.0.1:{server.port}", "127.0.0.1", f"localhost:{server.port}", "LocalHost", f"[::1]:{server.port}"):
        assert httpx.get(server.base_url + "/v1/models", headers={"Host": host}, timeout=10).status_code == 200, host


def test_cors_allows_only_the_configured_origins(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type, authorization"}
    allowed = httpx.options(server.base_url + CHAT, headers={"Origin": ORIGIN, **preflight}, timeout=10)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.options(server.base_url + CHAT, headers={"Origin": "https://evil.example", **preflight}, timeout=10)
    assert refused.status_code != 200 and "access-control-allow-origin" not in refused.headers
    plain = httpx.get(server.base_url + "/v1/models", headers={"Origin": "https://evil.example"}, timeout=10)
    assert "access-control-allow-origin" not in plain.headers


def test_n_over_max_n_is_400(server):
    for body in ({"messages": MSGS, "n": 5, "max_tokens": 2}, {"messages": MSGS, "n": 5, "max_tokens": 2, "use_beam_search": True}):
        assert "--max-n" in assert_error(httpx.post(server.base_url + CHAT, json=body, timeout=30), 400, param="n")


def test_n_that_could_never_be_queued_is_400_not_503(server):
    """--max-waiting-requests 3: n=4 (or 4 beams) can never fit, even on an idle server."""
    for extra in ({}, {"use_beam_search": True}):
        response = httpx.post(server.base_url + COMP, json={"prompt": "hi", "n": 4, "max_tokens": 2, **extra}, timeout=30)
        assert "could never be queued" in assert_error(response, 400, param="n")


def test_beam_search_counts_against_the_queue_and_503_says_when_to_retry(server):
    """One sequence runs (--max-num-seqs 1), a request of n=3 waits; a beam search of width 3 no longer
    slips past the queue limit of 3, and the 503 carries Retry-After."""
    with httpx.Client(base_url=server.base_url, timeout=60) as client, contextlib.ExitStack() as streams:
        running = streams.enter_context(
            client.stream("POST", COMP, json={"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True})
        )
        waiting = streams.enter_context(
            client.stream("POST", COMP, json={"prompt": "Once", "n": 3, "max_tokens": 100, "ignore_eos": True, "stream": True})
        )
        assert running.status_code == waiting.status_code == 200
        for body in ({"prompt": "hi", "n": 3, "max_tokens": 2, "use_beam_search": True}, {"prompt": "hi", "n": 3, "max_tokens": 2}):
            response = httpx.post(server.base_url + COMP, json=body, timeout=30)
            assert_error(response, 503, code="queue_full")
            assert int(response.headers["retry-after"]) >= 1
    # closing the two streams aborted them: the server serves again
    _wait_until_idle(server)
    ok = httpx.post(server.base_url + COMP, json={"prompt": "hi", "n": 3, "max_tokens": 2, "use_beam_search": True}, timeout=120)
    assert ok.status_code == 200, ok.text


def test_prompts_per_request_limit(server):
    response = httpx.post(server.base_url + COMP, json={"prompt": ["a", "b", "c", "d"], "max_tokens": 1}, timeout=30)
    assert "--max-prompts-per-request" in assert_error(response, 400, param="prompt")


def test_tokens_per_request_limit(server):
    """--max-tokens-per-request 600 counts prompts x n x (prompt + max_tokens), a missing max_tokens as the context."""
    cases = [
        (COMP, {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 100}, "n"),
        (COMP, {"prompt": ["a", "b", "c"], "max_tokens": 250}, "max_tokens"),
        (CHAT, {"messages": MSGS, "n": 2}, "n"),  # 2 x the 512-token context
    ]
    for path, body, param in cases:
        response = httpx.post(server.base_url + path, json=body, timeout=30)
        assert "--max-tokens-per-request" in assert_error(response, 400, param=param)
    # just under the limit: admitted and generating (the stream is closed after its first token, which
    # aborts the request: 450 tokens one sequence at a time would only cost the test time)
    body = {"prompt": ["a", "b", "c"], "max_tokens": 150, "stream": True}
    with httpx.stream("POST", server.base_url + COMP, json=body, timeout=120) as ok:
        assert ok.status_code == 200
        first = next(line for line in ok.iter_lines() if line)
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
    _wait_until_idle(server)


def _wait_until_idle(server, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(server.base_url + "/health", timeout=10).json()["num_requests_in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)

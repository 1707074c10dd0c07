"""The server's lifecycle against slow, silent and departing clients, through the real server process:
shutdown ends every response properly, slow headers and bodies are cut off, a hang-up mid-body is one log
line, and a request past its deadline ends as aborted."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from engine.entrypoints.openai.launcher import ServerProcess

pytestmark = pytest.mark.slow

SMALL = ["--max-model-len", "1024", "--kv-cache-memory", "128MiB"]
#: longer than any test waits: these requests only end when aborted
ENDLESS = {"max_tokens": 900, "ignore_eos": True}
#: the timeouts of the module's server, and how much later than the bound a drop may come on a busy machine
BOUND_S = 1.0
SLACK_S = 4.0


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(
        [*SMALL, "--header-timeout", str(BOUND_S), "--body-timeout", str(BOUND_S), "--request-timeout", "2"]
    )
    proc.start()
    yield proc
    proc.close()


class Stream:
    """A streamed request read on a thread: its ``data:`` lines, or the error that cut it."""

    def __init__(self, url: str, body: dict) -> None:
        self.lines: list[str] = []
        self.error: str | None = None
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as response:
                if response.status_code != 200:
                    self.error = f"{response.status_code}: {response.read().decode()}"
                    return
                self.lines.extend(line for line in response.iter_lines() if line.startswith("data: "))
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def chunks(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.lines if line != "data: [DONE]"]

    def assert_ended_as_aborted(self, num_choices: int = 1) -> None:
        self.thread.join(60)
        assert self.error is None, self.error
        assert self.lines and self.lines[-1] == "data: [DONE]", self.lines[-3:]
        reasons = {c["index"]: c["finish_reason"] for chunk in self.chunks() for c in chunk["choices"] if c["finish_reason"]}
        assert reasons == {i: "abort" for i in range(num_choices)}, reasons


class Call:
    """A non-streamed request run on a thread."""

    def __init__(self, url: str, body: dict) -> None:
        self.response: httpx.Response | None = None
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        self.response = httpx.post(url, json=body, timeout=60)


def health(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base_url}/health", timeout=10).json()


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def test_sigterm_ends_every_response_with_abort_and_exits_0():
    """After the grace period the engine aborts what still runs: each stream gets its finish_reason
    "abort" chunk and [DONE], a non-streamed request a whole JSON answer, and the process exits 0."""
    proc = ServerProcess([*SMALL, "--shutdown-timeout", "1"]).start()
    try:
        completion = Stream(f"{proc.base_url}/v1/completions", {"prompt": "Once upon a time", "stream": True, **ENDLESS})
        chat = Stream(
            f"{proc.base_url}/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Tell me a story"}], "stream": True, "n": 2, **ENDLESS},
        )
        whole = Call(f"{proc.base_url}/v1/completions", {"prompt": "Once upon a time", **ENDLESS})
        wait_for(lambda: completion.error or chat.error or (
            len(completion.lines) > 1 and len(chat.lines) > 1 and health(proc)["num_requests_in_flight"] == 3
        ))
        assert completion.error is None and chat.error is None, (completion.error, chat.error)
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer accepting, while the three still run
            httpx.get(f"{proc.base_url}/health", timeout=5)
        assert proc.stop(signal.SIGTERM, timeout_s=60) == 0
        completion.assert_ended_as_aborted()
        chat.assert_ended_as_aborted(num_choices=2)
        whole.thread.join(60)
        assert whole.response is not None and whole.response.status_code == 200
        assert [c["finish_reason"] for c in whole.response.json()["choices"]] == ["abort"]
        log = proc.log_tail(200_000)
        assert "Traceback" not in log and "aborting 3 request(s)" in log, log[-3000:]
    finally:
        proc.close()


def test_headers_sent_a_byte_at_a_time_are_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        start = time.monotonic()
        closed = False
        while not closed and time.monotonic() - start < BOUND_S + SLACK_S:
            try:
                sock.sendall(b"X")  # one byte of a never-ending header line every 100 ms
                sock.settimeout(0.1)
                closed = sock.recv(1024) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed, "a client trickling its headers was not dropped"
        assert time.monotonic() - start >= BOUND_S * 0.9


def test_a_silent_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        data, took = read_until_closed(sock, BOUND_S + SLACK_S)
    assert data == b"" and BOUND_S * 0.9 <= took < BOUND_S + SLACK_S


def test_a_body_that_does_not_arrive_in_time_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n" + b'{"prompt": "hi", '
        )
        data, took = read_until_closed(sock, BOUND_S + SLACK_S)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert BOUND_S * 0.9 <= took < BOUND_S + SLACK_S


def test_a_hang_up_mid_body_is_one_log_line(server):
    before = server.log_tail(1_000_000).count("hung up before sending its whole request body")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000\r\n\r\n" + b'{"messages": [{"role": "user", "content": "'
        )
    wait_for(lambda: server.log_tail(1_000_000).count("hung up before sending its whole request body") > before, 10)
    # the access log shows it as a client that closed its request (499), not as a server error
    hung_up = '"POST /v1/chat/completions" 499'
    wait_for(lambda: hung_up in server.log_tail(1_000_000), 10)
    log = server.log_tail(1_000_000)
    assert log.count("hung up before sending its whole request body") == before + 1
    assert '"POST /v1/chat/completions" 500' not in log
    assert "Traceback" not in log
    assert health(server)["status"] == "ok"


def test_a_request_past_its_deadline_ends_as_aborted(server):
    """--request-timeout 2: a stream and a whole response both end, early, as aborted."""
    start = time.monotonic()
    stream = Stream(f"{server.base_url}/v1/completions", {"prompt": "Once upon a time", "stream": True, **ENDLESS})
    whole = Call(f"{server.base_url}/v1/completions", {"prompt": "Once upon a time", **ENDLESS})
    stream.assert_ended_as_aborted()
    whole.thread.join(60)
    assert whole.response is not None and whole.response.status_code == 200, whole.response
    assert whole.response.json()["choices"][0]["finish_reason"] == "abort"
    assert time.monotonic() - start < 2 + SLACK_S
    assert "ran past its 2s deadline" in server.log_tail(1_000_000)
    wait_for(lambda: health(server)["num_requests_in_flight"] == 0, 10)


def test_keep_alive_connections_still_serve_several_requests(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for _ in range(3):
            response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert response.status_code == 200, response.text

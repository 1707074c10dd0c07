"""``engine serve`` with no arguments at all serves the embedded SmolLM2 on this machine, and SIGTERM stops it
with exit status 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

DEFAULT_URL = "http://127.0.0.1:8000"


def _port_8000_free() -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", 8000)) != 0


def test_serve_without_arguments():
    if not _port_8000_free():
        pytest.skip("port 8000 is in use; `engine serve` without arguments needs it")
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "engine.entrypoints.cli", "serve"], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while True:
                assert proc.poll() is None, _tail(log)
                try:
                    if httpx.get(f"{DEFAULT_URL}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, _tail(log)
                time.sleep(0.5)
            models = httpx.get(f"{DEFAULT_URL}/v1/models").json()["data"]
            assert "SmolLM2-135M-Instruct" in models[0]["id"]
            reply = httpx.post(
                f"{DEFAULT_URL}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12, "temperature": 0},
                timeout=120,
            ).json()
            assert "Paris" in reply["choices"][0]["message"]["content"]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, _tail(log)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _tail(log) -> str:
    log.seek(0)
    return log.read().decode("utf-8", "replace")[-3000:]

"""``engine serve`` with no arguments but a free port serves the embedded SmolLM2 on this machine under its Hub
id, and SIGTERM stops it with exit status 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from engine.entrypoints.openai.launcher import free_port
from engine.loader.paths import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow


def test_serve_without_arguments():
    # a free port, not the default 8000: the user's own server may be running there
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.entrypoints.cli", "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 600
            while True:
                assert proc.poll() is None, _tail(log)
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, _tail(log)
                time.sleep(0.5)
            models = httpx.get(f"{url}/v1/models").json()["data"]
            assert [m["id"] for m in models] == [DEFAULT_MODEL_NAME]
            reply = httpx.post(
                f"{url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12, "temperature": 0},
                timeout=120,
            ).json()
            assert "Paris" in reply["choices"][0]["message"]["content"]
            assert reply["model"] == DEFAULT_MODEL_NAME
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, _tail(log)
            # start-up said what it did and how long each phase took; each request got an access-log line
            output = _tail(log, 100_000)
            for phase in ("loaded the tokenizer in", "loaded the weights in", "tokenizer files (for tools"):
                assert phase in output, output
            assert '"POST /v1/chat/completions" 200 prompt_tokens=' in output, output
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _tail(log, num_chars: int = 3000) -> str:
    log.seek(0)
    return log.read().decode("utf-8", "replace")[-num_chars:]

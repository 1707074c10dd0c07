"""``engine generate`` and ``engine chat`` with the embedded model, as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_generate_streams_text():
    result = run_cli("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0", "--kv-cache-memory", "32MiB")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.slow
def test_chat_keeps_history():
    stdin = "What is the capital of France?\nRepeat your previous answer word for word.\n/exit\n"
    result = run_cli("chat", "--temperature", "0", "--max-tokens", "16", "--kv-cache-memory", "32MiB", stdin=stdin)
    assert result.returncode == 0, result.stderr
    replies = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(replies) >= 2 and "Paris" in replies[0]
    assert "Paris" in result.stdout.split(replies[0], 1)[1]  # the second answer saw the first

"""Start ``engine serve`` as a child process and wait until it answers (for tests, benchmarks, scripts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import httpx

from engine.ports import free_port


class ServerProcess:
    """``engine serve`` running in a child process on a free loopback port.

    Args:
        args: extra ``engine serve`` arguments (``--host``/``--port`` are chosen here).
        startup_timeout_s: how long loading the model may take.
        env: extra environment variables.
    """

    def __init__(self, args: Sequence[str] = (), startup_timeout_s: float = 600.0, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = ["serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.log = tempfile.NamedTemporaryFile(prefix="engine-serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        """Launch and block until ``/health`` says ok.

        Raises:
            RuntimeError: the process exited or did not become healthy in time (with its log's tail).
        """
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.entrypoints.cli", *self.args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"engine serve did not become healthy in {self.startup_timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-num_chars:]

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 120.0) -> int:
        """Send ``sig`` and wait for the process to exit; returns its exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"engine serve did not exit within {timeout_s:.0f}s of signal {sig}") from None
        return int(self.proc.returncode)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Stop the server if it still runs and remove its log."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.stop(timeout_s=30.0)
        finally:
            self.kill()
            self.log.close()
            os.unlink(self.log.name)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

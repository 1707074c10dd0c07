"""Reproduce the serving numbers in BENCHMARKS.md: start `engine serve` with the default model, then run
`engine bench serve` at several concurrencies and print a Markdown table (JSON per run in --out).

    python benchmarks/serving.py --concurrency 1 8 32 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform

from engine.bench.report import to_json
from engine.bench.serve import add_arguments, metrics_table, run_benchmark
from engine.entrypoints.openai.launcher import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompts-per-client", type=int, default=2, help="requests per concurrent client (min 8 in all)")
    parser.add_argument("--server-args", default="--kv-cache-memory 1GiB", help="extra `engine serve` arguments")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON results")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with ServerProcess(args.server_args.split()) as server:
        for c in args.concurrency:
            bench = argparse.ArgumentParser()
            add_arguments(bench)
            bench_args = bench.parse_args(
                ["--base-url", server.base_url, "--concurrency", str(c), "--num-prompts", str(max(8, c * args.prompts_per_client))]
            )
            metrics = asyncio.run(run_benchmark(bench_args))
            print(metrics_table(metrics), flush=True)
            with open(os.path.join(args.out, f"serve_c{c}.json"), "w", encoding="utf-8") as f:
                f.write(to_json(metrics) + "\n")
            rows.append((c, metrics))
    print(f"\nCPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")
    print("| concurrency | requests | req/s | output tok/s | TTFT mean / p50 / p99 (ms) | TPOT mean / p50 / p99 (ms) | ITL mean / p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|---|")
    for c, m in rows:
        print(f"| {c} | {m['completed']} | {m['request_throughput']:.2f} | {m['output_throughput']:.1f} | "
              f"{_trio(m['ttft_ms'])} | {_trio(m['tpot_ms'])} | {_trio(m['itl_ms'])} |")
    print(json.dumps({str(c): m["output_throughput"] for c, m in rows}))


def _trio(stats: dict[str, float]) -> str:
    return " / ".join(f"{stats[s]:,.0f}" for s in ("mean", "p50", "p99"))


if __name__ == "__main__":
    main()

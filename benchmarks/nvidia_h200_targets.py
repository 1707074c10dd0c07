"""Issue 32's figures on one H200 in one run: batch-1 decode end to end, 1000 x (512 in / 256 out) offline in
bf16 and in FP8 (W8A8 + FP8 KV cache), and `engine serve` under 64 and 256 streaming clients.

Each part runs in its own process (the GPU's memory is whole for each); the serving part starts
`engine serve` and drives it with `engine bench serve` (OpenAI's streaming completions protocol, closed-loop
clients that send their next request when the last one ends). Prints one table against the targets and
writes every part's JSON to --out.

    python benchmarks/nvidia_h200_targets.py --model .nvcarry/llama3-8b-dummy --out $OUT
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

HERE = os.path.dirname(os.path.abspath(__file__))
PORT = 8013


def run_json(args: list[str], path: str) -> dict[str, Any]:
    """Run a benchmark script that writes its JSON to ``path``; its output goes to ours."""
    proc = subprocess.run([sys.executable, *args, "--json", path], check=False)
    if proc.returncode != 0 or not os.path.isfile(path):
        return {"error": f"exit {proc.returncode}"}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def wait_healthy(base_url: str, server: subprocess.Popen, timeout_s: float = 400.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"engine serve exited with {server.returncode}")
        try:
            urllib.request.urlopen(base_url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError("engine serve did not come up")


def serve(args: argparse.Namespace) -> dict[str, Any]:
    """`engine serve` in bf16, then closed-loop streaming clients at each concurrency."""
    base_url = f"http://127.0.0.1:{PORT}"
    log = open(os.path.join(args.out, "serve.log"), "w", encoding="utf-8")  # noqa: SIM115 (the server's lifetime)
    server = subprocess.Popen(
        [sys.executable, "-m", "engine.entrypoints.cli", "serve", "--device", "cuda", "--model", args.model,
         "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "2048", "--port", str(PORT),
         *args.serve_args.split()],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    results: dict[str, Any] = {"serve_args": args.serve_args}
    try:
        wait_healthy(base_url, server)
        for concurrency in args.concurrency:
            path = os.path.join(args.out, f"serve_c{concurrency}.json")
            cmd = [sys.executable, "-m", "engine.entrypoints.cli", "bench", "serve", "--base-url", base_url,
                   "--concurrency", str(concurrency), "--num-prompts", str(concurrency * args.requests_per_client),
                   "--input-len", "512", "--output-len", "256", "--warmup", "8", "--json", path]  # fmt: skip
            subprocess.run(cmd, check=False)
            with open(path, encoding="utf-8") as fh:
                results[f"c{concurrency}"] = json.load(fh)
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", nargs="+", default=["decode", "bf16", "fp8", "serve"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--requests-per-client", type=int, default=4)
    # the step budget is the platform's default (8192 on a GPU) unless given here
    parser.add_argument("--serve-args", default="--max-num-seqs 256")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    h200 = os.path.join(HERE, "nvidia_h200.py")
    results: dict[str, Any] = {}
    if "decode" in args.parts:
        results["decode"] = run_json([h200, "decode", "--model", args.model], os.path.join(args.out, "decode.json"))
    if "bf16" in args.parts:
        results["bf16"] = run_json([h200, "throughput", "--model", args.model, "--hf-batch"],
                                   os.path.join(args.out, "offline_bf16.json"))  # fmt: skip
    if "fp8" in args.parts:
        results["fp8"] = run_json(
            [h200, "throughput", "--model", args.model, "--hf-batch", "--quantization", "fp8", "--kv-cache-dtype", "fp8"],
            os.path.join(args.out, "offline_fp8.json"),
        )
    if "serve" in args.parts:
        try:
            results["serve"] = serve(args)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            results["serve"] = {"error": str(exc)}
    with open(os.path.join(args.out, "targets.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    print(report(results))


def report(results: dict[str, Any]) -> str:
    rows = ["| figure | measured | target |", "|---|---|---|"]
    decode = results.get("decode", {})
    if "end_to_end_ratio_to_roofline_bytes_read" in decode:
        rows.append(f"| batch-1 end to end | {decode['decode_tok_s_end_to_end']:.1f} tok/s = "
                    f"{decode['end_to_end_ratio_to_roofline_bytes_read']:.3f} of the roofline | >= 0.92 |")  # fmt: skip
        rows.append(f"| batch-1 decode steps | {decode['decode_tok_s_graphs']:.1f} tok/s = "
                    f"{decode['ratio_to_roofline_bytes_read']:.3f} | |")  # fmt: skip
    offline = {}
    for key, target in (("bf16", 15000), ("fp8", 25000)):
        rate = results.get(key, {}).get("engine_output_tok_s")
        if rate is not None:
            offline[key] = rate
            rows.append(f"| offline {key} | {rate:,.0f} output tok/s | >= {target:,} |")
    for name, part in results.get("serve", {}).items():
        if not name.startswith("c") or not isinstance(part, dict):
            continue
        ttft = part.get("ttft_ms", {})
        rate = part.get("output_throughput", 0.0)
        vs = f" = {rate / offline['bf16']:.2f}x offline" if "bf16" in offline else ""
        target = "TTFT p99 < 1 s" if name == "c64" else ">= 0.9x offline, TTFT p99 < 3.5 s"
        rows.append(f"| serve {name[1:]} clients | {rate:,.0f} tok/s{vs}, TTFT p50 {ttft.get('p50', 0):,.0f} / "
                    f"p99 {ttft.get('p99', 0):,.0f} ms, TPOT p50 {part.get('tpot_ms', {}).get('p50', 0):.1f} ms | {target} |")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    main()

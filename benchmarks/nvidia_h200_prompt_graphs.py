"""A lone prompt's time to its first token, and batch-1 decode end to end, with and without the prompt graphs
(:mod:`engine.prefill_graphs`), alternated in one process on one engine (the graphs are switched off by
taking them from the runner). Also a profile of one 128-token prompt step each way: the device's kernel
time against the wall time, which says how much of an eager prompt step is the host's launches.

Usage (H200, dummy weights): python benchmarks/nvidia_h200_prompt_graphs.py --model DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvidia_h200 import copy_bandwidth, decode_rates, make_llm, weight_bytes  # noqa: E402


def first_token_ms(llm: Any, prompt_len: int, seed: int, repeats: int = 7, fresh: bool = True) -> float:
    """Median milliseconds of ``generate`` for one token of a ``prompt_len``-token prompt, a new one each
    time (``fresh``: prefix caching cannot shorten the step; each call needs its own ``seed``) or the same
    one (its whole blocks cached)."""
    from engine.sampling.params import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(seed * 100_003 + prompt_len)
    prompt = [rng.randint(1000, 40000) for _ in range(prompt_len)]
    times = []
    for _ in range(repeats + 1):
        if fresh:
            prompt = [rng.randint(1000, 40000) for _ in range(prompt_len)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[repeats // 2] * 1e3


def profile_prompt(llm: Any, seed: int, prompt_len: int = 128) -> dict[str, float]:
    """Wall time of one new prompt's step (``generate`` of one token) and the summed device time of its kernels."""
    from torch.profiler import ProfilerActivity, profile

    from engine.sampling.params import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(seed)
    llm.generate([[rng.randint(1000, 40000) for _ in range(prompt_len)]], one, use_tqdm=False)
    prompt = [rng.randint(1000, 40000) for _ in range(prompt_len)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(e.device_time for e in kernels)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
    return {"wall_ms": wall * 1e3, "kernel_ms": device_us / 1e3, "kernels": len(kernels)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default=None)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 128, 512, 1024])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    t0 = time.perf_counter()
    llm = make_llm(args.model, max_num_seqs=8, kv_cache_memory_bytes=8 * 2**30)
    start_s = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    graphs = runner.prefill_graphs
    report = getattr(getattr(graphs, "graphs", None), "report", None)
    _, read_bytes = weight_bytes(llm)
    roofline = bandwidth / read_bytes
    rows: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for recorded in (True, False):
            seed = 2 * round_ + recorded
            runner.prefill_graphs = graphs if recorded else None
            row: dict[str, Any] = {"prompt_graphs": recorded}
            for n in args.prompt_lens:
                row[f"first_token_ms_{n}"] = first_token_ms(llm, n, seed)
            row["first_token_ms_128_cached"] = first_token_ms(llm, 128, seed, fresh=False)
            steps, end_to_end = decode_rates(llm)
            row.update(decode_tok_s=steps, end_to_end_tok_s=end_to_end, end_to_end_ratio=end_to_end / roofline)
            rows.append(row)
            print(json.dumps(row), flush=True)
    profiles = {}
    for recorded in (True, False):
        runner.prefill_graphs = graphs if recorded else None
        profiles["graphs" if recorded else "eager"] = profile_prompt(llm, 1000 + recorded)
    result = {
        "copy_bandwidth_TBps": bandwidth / 1e12,
        "weight_GB_read_per_step": read_bytes / 1e9,
        "roofline_tok_s": roofline,
        "engine_start_s": start_s,
        "prompt_graph_buckets": graphs.buckets if graphs is not None else None,
        "prompt_graph_capture_s": report.seconds if report else None,
        "prompt_graph_MiB": report.memory_bytes / 2**20 if report else None,
        "rows": rows,
        "profile_128": profiles,
    }
    print("| prompt graphs | " + " | ".join(f"first token {n} (ms)" for n in args.prompt_lens)
          + " | 128 cached | decode tok/s | end to end tok/s (ratio) |")  # fmt: skip
    for row in rows:
        cells = [f"{row[f'first_token_ms_{n}']:.2f}" for n in args.prompt_lens]
        print(f"| {row['prompt_graphs']} | " + " | ".join(cells)
              + f" | {row['first_token_ms_128_cached']:.2f} | {row['decode_tok_s']:.1f} | {row['end_to_end_tok_s']:.1f} ({row['end_to_end_ratio']:.3f}) |")  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

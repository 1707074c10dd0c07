"""Where the H200 time goes: GEMV bandwidth per projection, the kernels of a batch-1 decode step, and the
host/GPU split of the offline throughput run. Prints short tables (diagnostics for BENCHMARKS.md's H200
section; the figures themselves come from benchmarks/nvidia_h200.py).

Usage: python benchmarks/nvidia_h200_profile.py {gemv,variants,kernels,host} --model DIR
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

#: Llama-3-8B projections (out, in) as the engine fuses them
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
GEMV_CONFIGS = [(8, 256, 4, 3), (16, 256, 4, 3), (16, 512, 4, 2), (16, 512, 8, 3), (32, 256, 8, 3),
                (32, 128, 4, 4), (64, 128, 8, 3), (8, 512, 4, 3), (4, 1024, 4, 2), (16, 1024, 8, 2)]


def _time_rotating(fn: Any, weights: list[torch.Tensor], x: torch.Tensor, repeats: int = 40) -> float:
    """Median seconds of one call, cycling through weight copies so that none sits in L2."""
    for w in weights[:3]:
        fn(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    times = []
    for _ in range(repeats // 4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(weights))
    return sorted(times)[len(times) // 2]


def cmd_gemv(args: argparse.Namespace) -> dict[str, dict[Any, float]]:
    """Seconds per call of cuBLAS and each Triton GEMV config, per projection (prints the best six)."""
    from engine_plugin_sdk.gpu.triton_kernels.gemv_launchers import gemv

    print(f"{'shape':10s} {'method':22s} {'us':>8s} {'TB/s':>6s}")
    results: dict[str, dict[Any, float]] = {}
    for name, (n, k) in SHAPES.items():
        if getattr(args, "shapes", None) and name not in args.shapes:
            continue
        copies = max(2, int(2e9 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, weights[0])
        rows: dict[Any, float] = {}
        rows["cublas"] = _time_rotating(lambda a, w: torch.nn.functional.linear(a, w), weights, x)
        rows["torch.mv"] = _time_rotating(lambda a, w: torch.mv(w, a[0]), weights, x)
        for bn, bk, nw, ns in GEMV_CONFIGS:
            def fn(a: torch.Tensor, w: torch.Tensor, bn: int = bn, bk: int = bk, nw: int = nw, ns: int = ns) -> Any:
                return gemv(a, w, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
            err = (fn(x, weights[0]).float() - ref.float()).abs().max().item()
            if err > 0.05 * ref.float().abs().max().item():
                print(f"{name:10s} triton {bn}x{bk} w{nw} s{ns}: WRONG (max err {err:.3g})")
                continue
            rows[(bn, bk, nw, ns)] = _time_rotating(fn, weights, x)
        results[name] = rows
        for label, t in sorted(rows.items(), key=lambda r: r[1])[:6]:
            text = label if isinstance(label, str) else "triton {}x{} w{} s{}".format(*label)
            print(f"{name:10s} {text:22s} {t * 1e6:8.1f} {n * k * 2 / t / 1e12:6.2f}")
        del weights
        torch.cuda.empty_cache()
    return results


def cmd_variants(args: argparse.Namespace) -> None:
    """Batch-1 decode tok/s of the plugin's options in one process (graphs recaptured per variant): the
    KV write fused into the decode kernel, programmatic dependent launch, the Triton GEMV for wide shapes."""
    from engine_plugin_nvidia import gemm
    from engine_plugin_sdk.gpu.triton_kernels import pdl

    sys.path.insert(0, str(Path(__file__).parent))
    from nvidia_h200 import copy_bandwidth, decode_rate, weight_bytes

    wide = gemm.GEMV_TILE
    if args.sweep:
        args.shapes = ["qkv", "gate_up", "lm_head"]
        pdl.configure(False)
        sweep = cmd_gemv(args)
        per_token = {"qkv": 32, "gate_up": 32, "lm_head": 1}
        configs = [c for c in GEMV_CONFIGS if all(c in sweep[s] for s in per_token)]
        best = min(configs, key=lambda c: sum(sweep[s][c] * w for s, w in per_token.items()))
        cublas = sum(sweep[s]["cublas"] * w for s, w in per_token.items())
        triton_us = sum(sweep[s][best] * w for s, w in per_token.items())
        print(f"wide GEMV per token: cuBLAS {cublas * 1e6:.0f} us, best Triton {best} {triton_us * 1e6:.0f} us")
        wide = dict(zip(("block_n", "block_k", "num_warps", "num_stages"), best, strict=True))
    bandwidth = copy_bandwidth()
    llm = _make_llm(args.model, max_num_seqs=8, kv_cache_memory_bytes=8 * 2**30)
    engine = llm.llm_engine
    report = engine.runner.decode_graphs.graphs.report
    print(f"capture at start-up: {report.memory_bytes / 2**20:.1f} MiB ({report.pool_bytes / 2**20:.1f} MiB pool), "
          f"{report.seconds:.2f} s; reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB")
    roof = bandwidth / weight_bytes(llm)[0]
    attention = engine.model.attention
    variants = [("baseline", False, False, None), ("fused kv", True, False, None), ("fused+pdl", True, True, None),
                ("fused+pdl+wide", True, True, wide), ("fused+wide", True, False, wide), ("pdl", False, True, None),
                ("fused+pdl (again)", True, True, None), ("baseline (again)", False, False, None)]
    if args.only:
        variants = [v for v in variants if v[0] in args.only]
    results = []
    if args.eager:  # eager launches with and without the PDL attribute (graph captures use it)
        graphs, engine.runner.decode_graphs = engine.runner.decode_graphs, None
        pdl.configure(True)
        for label, force in (("eager", False), ("eager, PDL launches", True), ("eager (again)", False)):
            with pdl.for_capture() if force else contextlib.nullcontext():
                rate = decode_rate(llm, new_tokens=96, repeats=1)
            print(f"{label:20s} {rate:7.1f} tok/s", flush=True)
        engine.runner.decode_graphs = graphs
    for label, fused, use_pdl, tile in variants:
        attention.fused_decode_write = fused
        pdl.configure(use_pdl)
        gemm.GEMV_WIDE_TILE = tile
        try:
            engine.runner.decode_graphs.capture()
            rate = decode_rate(llm, repeats=args.repeats)
        except Exception as exc:  # noqa: BLE001 - a failing variant is reported, the others still run
            print(f"{label}: FAILED {type(exc).__name__}: {exc}")
            continue
        results.append((label, rate))
        print(f"{label:20s} {rate:7.1f} tok/s  {rate / roof:.3f} of {roof:.1f}", flush=True)
    if args.profile:
        best_label = max(results, key=lambda r: r[1])[0] if results else "fused+pdl"
        _, fused, use_pdl, tile = next(v for v in variants if v[0] == best_label)
        attention.fused_decode_write, gemm.GEMV_WIDE_TILE = fused, tile
        pdl.configure(use_pdl)
        engine.runner.decode_graphs.capture()
        from engine.sampling.params import SamplingParams

        prompt = [random.Random(0).randint(1000, 40000) for _ in range(128)]
        params = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)
        prof, wall = _profiled(lambda: llm.generate([prompt], params, use_tqdm=False))
        _kernel_table(prof, f"batch 1 {best_label}, 1 prefill + 32 decode steps", wall, top=26)


def _make_llm(model: str, **kwargs: Any) -> Any:
    from engine.llm import LLM

    return LLM(model=model, device="cuda", dtype="bfloat16", load_format="dummy", **kwargs)


def _fp8_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.quantization != "auto":
        options["quantization"] = args.quantization
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    return options


#: kernel-name fragments per category, first match wins (Triton kernels keep their function names)
CATEGORIES = (("attention", ("paged_", "decode_merge", "write_kv")), ("fp8 quantize", ("quantize_rows",)),
              ("norm", ("rms_norm",)), ("rotary", ("rotary",)), ("silu*mul", ("silu_and_mul",)),
              ("gemv", ("gemv_kernel",)), ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "scaled_mm")))


def _category(name: str) -> str:
    return next((cat for cat, parts in CATEGORIES if any(p in name for p in parts)), "other")


def _kernel_table(prof: Any, label: str, wall: float, top: int = 22) -> None:
    kernels: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name[:60]][0] += 1
            kernels[evt.name[:60]][1] += evt.device_time
    total = sum(v[1] for v in kernels.values())
    print(f"--- {label}: wall {wall * 1e3:.1f} ms, kernel time {total / 1e3:.1f} ms, "
          f"{sum(v[0] for v in kernels.values())} kernels")
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{us / 1e3:8.2f} ms {count:6d}x {us / max(count, 1):8.1f} us  {name}")
    by_category: dict[str, float] = collections.defaultdict(float)
    for name, (_, us) in kernels.items():
        by_category[_category(name)] += us
    print("    by category: " + ", ".join(f"{cat} {us / 1e3:.1f} ms" for cat, us in
                                          sorted(by_category.items(), key=lambda kv: -kv[1])))


def _profiled(fn: Any) -> tuple[Any, float]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return prof, wall


def cmd_kernels(args: argparse.Namespace) -> None:
    """Kernel tables of batch-1 decode (graphs, eager), of full prefill steps, and of large decode batches."""
    from engine.sampling.params import SamplingParams

    rng = random.Random(0)
    if args.scenario == "b1":
        llm = _make_llm(args.model, max_num_seqs=8, kv_cache_memory_bytes=8 * 2**30)
        prompt = [rng.randint(1000, 40000) for _ in range(128)]
        params = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)
        for label in ("graphs", "eager"):
            if label == "eager":
                llm.llm_engine.runner.decode_graphs = None
                llm.generate([prompt], params, use_tqdm=False)
            prof, wall = _profiled(lambda: llm.generate([prompt], params, use_tqdm=False))
            _kernel_table(prof, f"batch 1 {label}, 1 prefill + 32 decode steps", wall)
        return
    llm = _make_llm(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    memory_fraction=0.85, max_model_len=1024, **_fp8_options(args))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate([[rng.randint(1000, 40000) for _ in range(512)] for _ in range(4)], params, use_tqdm=False)
    for i in range(args.num_prompts):
        engine.add_request(f"k{i}", [rng.randint(1000, 40000) for _ in range(512)], params, final_only=True)
    prefill_steps = -(-args.num_prompts * 512 // args.max_num_batched_tokens)
    prof, wall = _profiled(lambda: [engine.step() for _ in range(min(4, prefill_steps))])
    _kernel_table(prof, f"{min(4, prefill_steps)} prefill steps of {args.max_num_batched_tokens} tokens", wall)
    for _ in range(prefill_steps):
        engine.step()
    for _ in range(3):
        engine.step()
    prof, wall = _profiled(lambda: [engine.step() for _ in range(8)])
    _kernel_table(prof, f"8 decode steps at batch {len(engine.scheduler.running)}", wall)
    engine.abort_request([f"k{i}" for i in range(args.num_prompts)])


class _TimedSampler:
    """The runner's sampler with its calls timed (they end in the step's one host sync)."""

    def __init__(self, inner: Any, timers: dict[str, float], counts: dict[str, int]) -> None:
        self.inner, self.timers, self.counts = inner, timers, counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = self.inner(*a, **kw)
        self.timers["sample (incl. sync)"] += time.perf_counter() - t0
        self.counts["sample (incl. sync)"] += 1
        return out


def cmd_host(args: argparse.Namespace) -> None:
    from engine.sampling.params import SamplingParams

    llm = _make_llm(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    memory_fraction=0.85, max_model_len=1024, **_fp8_options(args))
    engine = llm.llm_engine
    timers: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)

    def timed(obj: Any, name: str, key: str, sync: bool = False) -> None:
        inner = getattr(obj, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            if sync:
                torch.cuda.synchronize()
            timers[key] += time.perf_counter() - t0
            counts[key] += 1
            return out
        setattr(obj, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.runner, "prepare", "prepare")
    timed(engine.runner.model, "forward", "forward eager (launch+sync)", sync=True)
    if engine.runner.decode_graphs is not None:
        timed(engine.runner.decode_graphs, "run", "decode graph run (sync)", sync=True)
    engine.runner.sampler = _TimedSampler(engine.runner.sampler, timers, counts)
    timed(engine, "step", "step total")
    rng = random.Random(0)
    prompts = [[rng.randint(1000, 40000) for _ in range(512)] for _ in range(args.num_prompts)]
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    timers.clear()
    counts.clear()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{args.num_prompts} x (512 in, 256 out): {seconds:.1f} s, {produced / seconds:,.0f} output tok/s "
          f"(max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens})")
    for key in sorted(timers, key=lambda k: -timers[k]):
        print(f"{key:32s} {timers[key]:7.2f} s  {counts[key]:6d} calls  {timers[key] / counts[key] * 1e3:7.2f} ms/call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("gemv")
    p = sub.add_parser("variants")
    p.add_argument("--model", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--sweep", action="store_true", help="choose the wide GEMV tile by a GEMV sweep first")
    p.add_argument("--eager", action="store_true", help="eager decode with and without PDL launches")
    p.add_argument("--only", nargs="*", default=None, help="graph variants to run (labels)")
    for name in ("kernels", "host"):
        p = sub.add_parser(name)
        p.add_argument("--scenario", choices=["b1", "batch"], default="b1")
        p.add_argument("--model", required=True)
        p.add_argument("--num-prompts", type=int, default=1000)
        p.add_argument("--max-num-seqs", type=int, default=512)
        p.add_argument("--max-num-batched-tokens", type=int, default=8192)
        p.add_argument("--quantization", default="auto", choices=["auto", "fp8"])
        p.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    {"gemv": cmd_gemv, "variants": cmd_variants, "kernels": cmd_kernels, "host": cmd_host}[args.command](args)


if __name__ == "__main__":
    main()

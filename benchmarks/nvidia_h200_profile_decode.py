"""Where a batch-1 decode step's time goes on the H200, for the dense shapes of nvidia_h200_dense.py.

The shapes are Gemma-2-9B and Qwen3-8B: the step split into its graph, LM head and greedy pick, kernel
tables, the GEMMs alone and the decode attention alone, each against the copy bandwidth measured in the
same run.

One call prints, per shape (config-only folders with dummy bf16 weights, as ``nvidia_h200_dense.py decode``):

1. ``step``: CUDA events around the decode graph's replay, ``compute_logits`` and the greedy pick over
   ``--steps`` steady-state steps (medians), and the step period (graph start to graph start); the
   roofline of the bytes a step reads (every weight but the embedding table, plus the LM head).
2. ``kernels``: torch.profiler over the same steps with graphs and eagerly: the top kernels by CUDA time,
   µs per step and share. Under PDL a kernel's time includes its wait for the one before, so the graph
   table over-counts small kernels; the event split of (1) is the figure to trust for the step.
3. ``gemms``: each projection alone, all layers' weights in one CUDA graph (no weight sits in L2), and
   the LM head eagerly (the engine runs it after the graph): µs per product and TB/s; ``--sweep`` adds the
   Triton GEMV tiles of ``nvidia_h200_profile.py`` on the model's own shapes.
4. ``attention``: the decode-attention launcher at the model's heads, one call per layer in a CUDA graph,
   at a few context lengths and split counts (the graph's count is the one the engine captures with).
5. ``--variants``: batch-1 decode tok/s with the LM-head GEMV and the split greedy pick switched off
   (the path before them) and on, in one process (both run after the graph, so no recapture).

Usage (repository root, on the device machine after ``source benchmarks/nvidia_h200_setup.sh``)::

    python benchmarks/nvidia_h200_profile_decode.py --tokenizer .nvcarry/llama3-8b-dummy --variants
    python benchmarks/nvidia_h200_profile_decode.py --tokenizer .nvcarry/llama3-8b-dummy --shapes gemma2-9b --sweep
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "core" / "tests")]

from nvidia_h200 import copy_bandwidth, decode_rate, weight_bytes  # noqa: E402
from nvidia_h200_dense import SHAPES, tokenizer_only  # noqa: E402
from nvidia_h200_profile import GEMV_CONFIGS, _category, _time_rotating  # noqa: E402

#: the four projections of a layer, as DecoderLayer names them
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


def make_llm(shape: str, tokenizer: str, tmp: str) -> Any:
    from engine import LLM

    folder = tokenizer_only(tokenizer, os.path.join(tmp, shape))
    Path(folder, "config.json").write_text(json.dumps(SHAPES[shape]), encoding="utf-8")
    return LLM(model=folder, device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=8,
               kv_cache_memory_bytes=8 << 30, max_model_len=4096)  # fmt: skip


class _Timed:
    """Records a CUDA event pair around each call of ``obj.name`` (the stream's order, not the host's)."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name, self.inner = obj, name, getattr(obj, name)
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

        def wrapper(*a: Any, **kw: Any) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.inner(*a, **kw)
            end.record()
            self.pairs.append((start, end))
            return out

        setattr(obj, name, wrapper)

    def restore(self) -> None:
        setattr(self.obj, self.name, self.inner)

    def durations_us(self) -> list[float]:
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in self.pairs]

    def periods_us(self) -> list[float]:
        torch.cuda.synchronize()
        return [a[0].elapsed_time(b[0]) * 1e3 for a, b in zip(self.pairs, self.pairs[1:])]


def _decode_steps(llm: Any, steps: int, fn: Callable[[], None] | None = None, requests: int = 1) -> None:
    """``requests`` requests, their prefill and two decode steps outside ``fn``; then ``fn`` runs around ``steps``
    steps."""
    from engine.sampling.params import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"profile{i}" for i in range(requests)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randint(1000, 40000) for _ in range(128)], params, final_only=True)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    if fn is None:
        for _ in range(steps):
            engine.step()
    else:
        fn()
    torch.cuda.synchronize()
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def step_split(llm: Any, steps: int) -> dict[str, float]:
    """Median µs per decode step of the graph replay, the logits, the greedy pick, and the step period."""
    engine = llm.llm_engine
    runner = engine.runner
    timers = {"graph": _Timed(runner.decode_graphs, "run"), "logits": _Timed(runner.model, "compute_logits"),
              "greedy pick": _Timed(runner.sampler, "greedy_on_device")}  # fmt: skip
    try:
        _decode_steps(llm, steps)
    finally:
        for t in timers.values():
            t.restore()
    out = {name: statistics.median(t.durations_us()[-steps:]) for name, t in timers.items()}
    out["step period"] = statistics.median(timers["graph"].periods_us()[-steps + 1 :])
    return out


def _profiled_kernels(llm: Any, steps: int, requests: int = 1) -> list[Any]:
    """torch.profiler's CUDA events over ``steps`` steady decode steps of ``requests`` sequences (the prefill and
    the first decodes run before the profiler starts)."""
    from torch.profiler import ProfilerActivity, profile

    profiled: list[Any] = []

    def steady_steps() -> None:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                llm.llm_engine.step()
            torch.cuda.synchronize()
        profiled.append(prof)

    _decode_steps(llm, steps, steady_steps, requests)
    return [e for e in profiled[0].events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_table(llm: Any, steps: int, graphs: bool, top: int) -> list[tuple[str, int, float, float]]:
    """(name, launches per step, µs per step, share) of the top kernels over ``steps`` decode steps."""
    runner = llm.llm_engine.runner
    saved = runner.decode_graphs
    if not graphs:
        runner.decode_graphs = None
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    try:
        events = _profiled_kernels(llm, steps)
    finally:
        runner.decode_graphs = saved
    for evt in events:
        kernels[evt.name[:70]][0] += 1
        kernels[evt.name[:70]][1] += evt.device_time
    total = sum(v[1] for v in kernels.values())
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    per = max(1, steps)
    table = [(name, round(n / per), us / per, us / total) for name, (n, us) in rows]
    by_cat: dict[str, float] = collections.defaultdict(float)
    for name, _, _us, share in table:
        by_cat[_category(name)] += share
    label = "graphs" if graphs else "eager"
    print(f"  kernels ({label}): {total / per / 1e3:.2f} ms of kernel time per step over {steps} steps; by category: "
          + ", ".join(f"{c} {s:.1%}" for c, s in sorted(by_cat.items(), key=lambda kv: -kv[1])))  # fmt: skip
    print(f"  {'us/step':>9s} {'share':>6s} {'n/step':>6s}  kernel")
    for name, n, us, share in table[:top]:
        print(f"  {us:9.1f} {share:6.1%} {n:6d}  {name}")
    return table[:top]


def layer_products(llm: Any, steps: int, requests: int = 1) -> list[tuple[str, int, float]]:
    """``(product, launches per step, µs each)`` of a decode step's kernels (``requests`` sequences) in the graphs, each named by
    where it falls in its layer: ``qkv.0`` / ``qkv.1`` the products between a layer's first norm and its attention
    (one, or two where a mixed-type projection runs as row blocks), ``o_proj.0`` those after the attention,
    ``mlp.0`` / ``mlp.1`` those after the second norm; the other kernels by name. Run it without PDL
    (``ENGINE_NVIDIA_PDL=0``): under PDL a kernel's time includes its wait for the one before."""
    events = sorted(_profiled_kernels(llm, steps, requests), key=lambda e: e.time_range.start)
    records: list[list[Any]] = []
    segment, index, seen_attention = "qkv", 0, False
    for evt in events:
        name = evt.name
        if "rms_norm" in name:
            # a norm after the attention opens the MLP; any other (the layer's first, the final one) the q/k/v
            segment, index, seen_attention = ("mlp" if seen_attention else "qkv"), 0, False
        elif "decode" in name and ("paged" in name or "merge" in name):
            segment, index, seen_attention = "o_proj", 0, True
        elif "greedy" in name and records and records[-1][0].startswith("qkv"):
            records[-1][0] = "lm_head"  # the product after the final norm, before the pick
        if "gemv" in name or "gemm" in name:
            records.append([f"{segment}.{index}", evt.device_time])
            index += 1
        else:
            records.append([name[:60], evt.device_time])
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for label, us in records:
        totals[label][0] += 1
        totals[label][1] += us
    rows = [(label, round(n / steps), us / n) for label, (n, us) in totals.items()]
    rows.sort(key=lambda r: -r[1] * r[2])
    print(f"  {'product':>60s} {'n/step':>6s} {'us each':>8s} {'us/step':>8s}")
    for label, n, us in rows:
        print(f"  {label:>60s} {n:6d} {us:8.2f} {n * us:8.1f}")
    return rows


def _graph_time_us(fn: Callable[[], None], repeats: int = 20) -> float:
    """Median µs of one replay of a CUDA graph of ``fn``."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def gemms(llm: Any, bandwidth: float, sweep: bool) -> dict[str, dict[str, float]]:
    """Each projection over all layers in one graph, and the LM head eagerly (both paths)."""
    from engine_plugin_nvidia import gemm as nv_gemm
    from engine_plugin_sdk.gpu.triton_kernels import pdl

    model = llm.llm_engine.model
    out: dict[str, dict[str, float]] = {}
    print(f"  {'product':10s} {'N x K':>14s} {'us':>8s} {'TB/s':>6s} {'of copy':>7s}")
    step_us = 0.0
    for name in PROJECTIONS:
        weights = [getattr(layer, name) for layer in model.layers]
        n, k = weights[0].shape
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        with pdl.for_capture():  # as the engine captures its graphs
            us = _graph_time_us(lambda x=x, weights=weights: [model.gemm.linear(x, w) for w in weights]) / len(weights)
        tbps = n * k * 2 / us / 1e6
        step_us += us * len(weights)
        out[name] = {"us": us, "TBps": tbps}
        print(f"  {name:10s} {f'{n}x{k}':>14s} {us:8.1f} {tbps:6.2f} {tbps * 1e12 / bandwidth:7.1%}")
        if sweep:
            for cfg in GEMV_CONFIGS + [(8, 512, 4, 2), (4, 512, 4, 3)]:
                bn, bk, nw, ns = cfg

                def fn(a: torch.Tensor, w: torch.Tensor, bn: int = bn, bk: int = bk, nw: int = nw, ns: int = ns) -> Any:
                    from engine_plugin_sdk.gpu.triton_kernels.gemv_launchers import gemv

                    return gemv(a, w, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)

                t = _time_rotating(fn, weights, x) * 1e6
                out[name][f"gemv {cfg}"] = t
                print(f"    gemv {bn}x{bk} w{nw} s{ns}: {t:8.1f} us {n * k * 2 / t / 1e6:6.2f} TB/s")
    head = model.lm_head
    n, k = head.shape
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    saved = nv_gemm.LOGITS_GEMV_TILE
    for label, tile in (("lm_head cuBLAS+cast", None), ("lm_head GEMV fp32", saved or nv_gemm.GEMV_TILE)):
        nv_gemm.LOGITS_GEMV_TILE = tile
        for _ in range(3):
            model.gemm.logits(x, head)
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model.gemm.logits(x, head)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        us = statistics.median(times)
        tbps = n * k * 2 / us / 1e6
        out[label] = {"us": us, "TBps": tbps}
        print(f"  {label:10s} {f'{n}x{k}':>14s} {us:8.1f} {tbps:6.2f} {tbps * 1e12 / bandwidth:7.1%}")
    nv_gemm.LOGITS_GEMV_TILE = saved
    out["layers_total"] = {"us": step_us}
    print(f"  the layers' GEMMs: {step_us / 1e3:.3f} ms a step")
    return out


def attention(llm: Any, contexts: tuple[int, ...] = (136, 1024, 4096)) -> dict[str, float]:
    """The decode attention launcher at the model's heads: µs per layer (decode + merge) in a graph of one
    call per layer, per context length and split count, window and soft-cap as the model's layers."""
    from engine_plugin_sdk.gpu.triton_kernels import launchers, pdl

    engine = llm.llm_engine
    model, cfg = engine.model, engine.model.config
    backend = model.attention
    tuning = backend.tuning
    kv_cache = engine.runner.block_cache.kv_caches[0]
    block_size = kv_cache.shape[2]
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    graph_splits = tuning.decode_splits(1, kv_heads, None)
    windows = [layer.window for layer in model.layers]
    cap = model.spec.attn_soft_cap
    out: dict[str, float] = {}
    print(f"  attention, {heads} heads / {kv_heads} KV heads x {d}, cap {cap}; graph split count {graph_splits}")
    for ctx in contexts:
        blocks = -(-ctx // block_size)
        table = torch.randperm(kv_cache.shape[1] - 1, device="cuda")[:blocks].to(torch.int32).view(1, -1) + 1
        seq_lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        q = torch.randn(1, heads, d, device="cuda", dtype=torch.bfloat16)
        o = torch.empty_like(q)
        line = []
        for splits in sorted({graph_splits, 16, 8, 4, 1}, reverse=True):
            def run(splits: int = splits, args: tuple = (o, q, kv_cache, table, seq_lens)) -> None:
                for w in windows:
                    launchers.paged_decode(*args, model.scale, splits, tuning, window=w, soft_cap=cap)

            with pdl.for_capture():
                us = _graph_time_us(run) / len(windows)
            out[f"ctx {ctx} splits {splits}"] = us
            line.append(f"{splits}: {us:5.1f}")
        print(f"    context {ctx:5d}: us per layer by splits  " + "  ".join(line))
    return out


def variants(llm: Any, roofline: float) -> dict[str, float]:
    """Decode tok/s with the LM-head GEMV and the split greedy pick off (before) and on (after)."""
    from engine_plugin_nvidia import gemm as nv_gemm
    from engine_plugin_sdk.gpu.triton_kernels import launchers

    saved = (nv_gemm.LOGITS_GEMV_TILE, launchers.GREEDY_SPLIT)
    rows = [("before (cuBLAS head, one-pass pick)", None, False), ("GEMV head", saved[0], False),
            ("split pick", None, True), ("after (both)", saved[0], True), ("before (again)", None, False),
            ("after (again)", saved[0], True)]  # fmt: skip
    out = {}
    for label, tile, split in rows:
        # both run after the graph, eagerly: no recapture needed
        nv_gemm.LOGITS_GEMV_TILE, launchers.GREEDY_SPLIT = tile, split
        rate = decode_rate(llm)
        out[label] = rate
        print(f"    {label:38s} {rate:7.1f} tok/s = {rate / roofline:.3f} of the roofline", flush=True)
    nv_gemm.LOGITS_GEMV_TILE, launchers.GREEDY_SPLIT = saved
    return out


def graph_variants(llm: Any, roofline: float) -> dict[str, float]:
    """Decode tok/s with the decode attention kernel's tiles varied (keys per iteration, warps, the most
    splits of a context), graphs recaptured for each row, rows interleaved. (The GEMVs' PDL prefetch depth
    and the fusions were compared the same way in earlier sessions: BENCHMARKS.md.)"""
    import dataclasses

    engine = llm.llm_engine
    attention = engine.runner.model.attention
    saved = attention.tuning
    rows: list[tuple[str, dict]] = [
        ("default tiles", {}), ("decode block_n 32", {"decode_block_n": 32}),
        ("decode block_n 16", {"decode_block_n": 16}),
        ("decode block_n 32, 8 warps", {"decode_block_n": 32, "decode_num_warps": 8}),
        ("decode 8 warps", {"decode_num_warps": 8}), ("at most 16 splits", {"max_decode_splits": 16}),
        ("default tiles (again)", {}), ("decode block_n 32 (again)", {"decode_block_n": 32}),
    ]  # fmt: skip
    out = {}
    for label, change in rows:
        attention.tuning = dataclasses.replace(saved, **change)
        engine.runner.decode_graphs.capture()
        rate = decode_rate(llm)
        out[label] = rate
        print(f"    {label:38s} {rate:7.1f} tok/s = {rate / roofline:.3f} of the roofline", flush=True)
    attention.tuning = saved
    engine.runner.decode_graphs.capture()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a folder holding a HF tokenizer (its other files are ignored)")
    parser.add_argument("--shapes", nargs="+", default=["gemma2-9b", "qwen3-8b"], choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled (default 16)")
    parser.add_argument("--top", type=int, default=16, help="kernels listed per table (default 16)")
    parser.add_argument("--no-eager", action="store_true", help="skip the eager kernel table")
    parser.add_argument("--sweep", action="store_true", help="time the Triton GEMV tiles on each projection too")
    parser.add_argument("--variants", action="store_true", help="decode tok/s before / after the LM-head and pick changes")
    parser.add_argument("--graph-variants", action="store_true",
                        help="decode tok/s with the decode attention kernel's tiles varied")
    parser.add_argument("--skip-profile", action="store_true", help="only the decode rate and the variants")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    results: dict[str, Any] = {"copy_bandwidth_TBps": bandwidth / 1e12}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            t0 = time.perf_counter()
            llm = make_llm(shape, args.tokenizer, tmp)
            _, read = weight_bytes(llm)
            roofline = bandwidth / read
            rate = decode_rate(llm)
            print(f"=== {shape}: {read / 1e9:.2f} GB a step, roofline {roofline:.1f} tok/s ({1e6 / roofline:.0f} us), "
                  f"decode {rate:.1f} tok/s = {rate / roofline:.3f} (load {time.perf_counter() - t0:.0f} s)", flush=True)
            res: dict[str, Any] = {"GB_read_per_step": read / 1e9, "roofline_tok_s": roofline, "decode_tok_s": rate}
            if args.graph_variants:
                res["graph_variants"] = graph_variants(llm, roofline)
            if args.skip_profile:
                results[shape] = res
                del llm
                gc.collect()
                torch.cuda.empty_cache()
                continue
            split = step_split(llm, args.steps)
            res["step_us"] = split
            print("  step (us, medians): " + ", ".join(f"{k} {v:.1f}" for k, v in split.items())
                  + f"; rest of the period {split['step period'] - split['graph'] - split['logits'] - split['greedy pick']:.1f}")
            res["kernels_graphs"] = kernel_table(llm, args.steps, True, args.top)
            if not args.no_eager:
                res["kernels_eager"] = kernel_table(llm, min(args.steps, 4), False, args.top)
            res["gemms"] = gemms(llm, bandwidth, args.sweep)
            res["attention"] = attention(llm)
            if args.variants:
                res["variants"] = variants(llm, roofline)
            results[shape] = res
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()

"""H200 benchmarks of the NVIDIA plugin on a Llama-3-8B-shaped dummy model (see BENCHMARKS.md).

Subcommands (each prints a short table and writes JSON):
  decode      (a) batch-1 decode tokens/s against the copy-bandwidth roofline, (d) CUDA graphs on vs off
  throughput  (b) 1000 requests of 512 random input tokens / 256 output tokens, and HF generate
  hf          HF generate alone, at each ``--hf-batch`` size (to find its best batch size)

Usage: python benchmarks/nvidia_h200.py {decode,throughput,hf} --model DIR [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import random
import time
import types
from pathlib import Path
from typing import Any

import torch


def copy_bandwidth(gib: float = 4.0, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n / sorted(times)[len(times) // 2]


def make_llm(model: str, **kwargs: Any) -> Any:
    from engine.llm import LLM

    return LLM(model=model, device="cuda", dtype="bfloat16", load_format="dummy", **kwargs)


def weight_bytes(llm: Any) -> tuple[int, int]:
    """(all parameter bytes, bytes one decode step reads: everything but the embedding table)."""
    model = llm.llm_engine.model
    total = model.embed_tokens.numel() * model.embed_tokens.element_size()
    read = 0
    for layer in model.layers:
        # every tensor a layer holds (weights, biases, norm scales), whatever the architecture's layout
        for field in dataclasses.fields(layer):
            t = getattr(layer, field.name)
            if isinstance(t, torch.Tensor):
                read += t.numel() * t.element_size()
    read += model.lm_head.numel() * model.lm_head.element_size() + model.final_norm.numel() * 2
    return total + read, read


def decode_rate(llm: Any, prompt_len: int = 128, new_tokens: int = 256, repeats: int = 3) -> float:
    """Batch-1 decode tokens/s: (time to generate new_tokens - time to generate 1) over new_tokens - 1."""
    return decode_rates(llm, prompt_len, new_tokens, repeats)[0]


def decode_rates(llm: Any, prompt_len: int = 128, new_tokens: int = 256, repeats: int = 3) -> tuple[float, float]:
    """Batch-1 tokens/s, the decode steps alone and end to end.

    Returns:
        (new_tokens - 1 over the time of new_tokens minus the time of one, new_tokens over the whole
        ``generate`` call, the prefill and the host's work included), medians of ``repeats``.
    """
    from engine.sampling.params import SamplingParams

    rng = random.Random(0)
    prompt = [rng.randint(1000, 40000) for _ in range(prompt_len)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], many, use_tqdm=False)  # warm-up
    rates, end_to_end = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate([prompt], many, use_tqdm=False)
        t2 = time.perf_counter()
        rates.append((new_tokens - 1) / ((t2 - t1) - (t1 - t0)))
        end_to_end.append(new_tokens / (t2 - t1))
    return sorted(rates)[len(rates) // 2], sorted(end_to_end)[len(end_to_end) // 2]


def batched_decode_rate(llm: Any, batch: int, prompt_len: int = 128, new_tokens: int = 256) -> float:
    """Output tokens/s of ``batch`` sequences decoding together, the decode steps alone: ``batch * (new_tokens
    - 1)`` over the time of ``new_tokens`` minus that of one (distinct prompts, median of three)."""
    from engine.sampling.params import SamplingParams

    rng = random.Random(batch)
    prompts = [[rng.randint(1000, 40000) for _ in range(prompt_len)] for _ in range(batch)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, many, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(prompts, many, use_tqdm=False)
        t2 = time.perf_counter()
        rates.append(batch * (new_tokens - 1) / ((t2 - t1) - (t1 - t0)))
    return sorted(rates)[1]


def release() -> None:
    """Return freed GPU memory (the caller has dropped its engine) before the next engine starts."""
    gc.collect()
    torch.cuda.empty_cache()


def override_tuning(**changes: Any) -> None:
    """Start the NVIDIA plugin's engines with these ``KernelTuning`` fields changed (the A/B of a default)."""
    import dataclasses

    import engine_plugin_nvidia.tuning as nvidia_tuning

    tuned = nvidia_tuning.tuning_for_device
    nvidia_tuning.tuning_for_device = lambda interpret: dataclasses.replace(  # type: ignore[assignment]
        tuned(interpret), **changes
    )


#: the NVIDIA plugin's batch-1 GEMV tiles a ``--gemv-tiles`` part names (``engine_plugin_nvidia.gemm``)
GEMV_TILE_NAMES = {"narrow": "GEMV_TILE", "wide": "GEMV_WIDE_TILE", "gated": "GATED_GEMV_TILE", "logits": "LOGITS_GEMV_TILE"}


def use_gemv_tiles(spec: str) -> dict[str, dict]:
    """Start the NVIDIA plugin's engines with batch-1 GEMV tiles ``spec`` (the A/B of a tile): ``default``, or
    parts ``name=block_n,block_k,warps,stages,prefetch`` joined by ``+`` with ``name`` one of
    :data:`GEMV_TILE_NAMES` (narrow: o_proj, down_proj, a MoE's router; wide: q/k/v inside graphs). The first call
    remembers the defaults; each call starts from them. Returns the tiles set."""
    import engine_plugin_nvidia.gemm as nvidia_gemm

    defaults = use_gemv_tiles.__dict__.setdefault(
        "defaults", {attr: getattr(nvidia_gemm, attr) for attr in GEMV_TILE_NAMES.values()}
    )
    for attr, tile in defaults.items():
        setattr(nvidia_gemm, attr, tile)
    chosen: dict[str, dict] = {}
    for part in ([] if spec == "default" else spec.split("+")):
        name, _, values = part.partition("=")
        block_n, block_k, warps, stages, prefetch = (int(v) for v in values.split(","))
        tile = {"block_n": block_n, "block_k": block_k, "num_warps": warps, "num_stages": stages, "prefetch": prefetch}
        setattr(nvidia_gemm, GEMV_TILE_NAMES[name], tile)
        chosen[name] = tile
    return chosen


def load_module(name: str, path: str) -> types.ModuleType:
    """The Python module in file ``path`` (an earlier commit's kernel module, for an A/B), imported as ``name``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use_decode_kernel_from(path: str) -> types.ModuleType:
    """Launch the decode attention kernel of ``path`` (a kernel module of an earlier commit, e.g. ``git show
    REV:plugin_sdk/engine_plugin_sdk/gpu/triton_kernels/attention_kernels.py``) in this process: the A/B of a
    kernel change. Programs of one KV head, the query scaled in the scores, as that kernel takes them. Where a
    file ``<path's stem>_merge.py`` lies beside it (that commit's ``decode_merge_kernels.py``), its split merge
    runs too."""
    from engine_plugin_sdk.gpu.triton_kernels import launchers

    before = load_module("decode_kernel_before", path)
    merge_path = Path(path).with_name(Path(path).stem + "_merge.py")
    if merge_path.exists():
        launchers.dmk = load_module("decode_merge_before", str(merge_path))  # type: ignore[attr-defined]

    class Launch:
        def __getitem__(self, grid: Any) -> Any:
            launch = before.paged_decode_kernel[grid]

            def call(*args: Any, KV_HEADS: int = 1, PRESCALED: bool = False, **kwargs: Any) -> Any:  # noqa: N803
                assert KV_HEADS == 1, "the earlier kernel takes one KV head a program"
                # as its launcher passed it (the early read on every launch under PDL, session 44 narrowed it)
                kwargs["EARLY_KV"] = early_kv
                return launch(*args, **kwargs)

            return call

    from engine_plugin_nvidia.tuning import tuning_for_device

    early_kv = tuning_for_device(False).decode_early_kv
    override_tuning(decode_paired_fp8=None)
    launchers.dak = types.SimpleNamespace(paged_decode_kernel=Launch())  # type: ignore[attr-defined]
    return before


def cmd_decode(args: argparse.Namespace) -> dict[str, Any]:
    from nvidia_moe_variants import use_l2_ahead

    use_l2_ahead()  # a no-op unless ENGINE_BENCH_L2_AHEAD=1
    if args.late_kv:
        override_tuning(decode_early_kv=False)
    if args.min_split_keys is not None:
        override_tuning(decode_min_split_keys=args.min_split_keys)
    if args.decode_kernel_from:
        use_decode_kernel_from(args.decode_kernel_from)
    if args.gemv_tiles:
        use_gemv_tiles(args.gemv_tiles)
    if args.merge_last:
        override_tuning(decode_merge_last=True)
    bandwidth = copy_bandwidth()
    t0 = time.perf_counter()
    llm = make_llm(args.model, max_num_seqs=8, kv_cache_memory_bytes=8 * 2**30)
    load_s = time.perf_counter() - t0
    graphs = llm.llm_engine.runner.decode_graphs
    report = getattr(getattr(graphs, "graphs", None), "report", None)
    all_bytes, read_bytes = weight_bytes(llm)
    with_graphs, end_to_end = decode_rates(llm)
    llm.llm_engine.runner.decode_graphs = None
    eager = decode_rate(llm)
    result = {
        "decode_kernel_from": args.decode_kernel_from,
        "min_split_keys": args.min_split_keys,
        "gemv_tiles": args.gemv_tiles,
        "merge_last": args.merge_last,
        "copy_bandwidth_TBps": bandwidth / 1e12,
        "weight_GB_all": all_bytes / 1e9,
        "weight_GB_read_per_step": read_bytes / 1e9,
        "roofline_tok_s_all_weights": bandwidth / all_bytes,
        "roofline_tok_s_bytes_read": bandwidth / read_bytes,
        "decode_tok_s_graphs": with_graphs,
        "decode_tok_s_eager": eager,
        "graph_speedup": with_graphs / eager,
        "ratio_to_roofline_all_weights": with_graphs / (bandwidth / all_bytes),
        "ratio_to_roofline_bytes_read": with_graphs / (bandwidth / read_bytes),
        # the whole call: a 128-token prefill, 256 tokens, the host's work (issue 32's figure)
        "decode_tok_s_end_to_end": end_to_end,
        "end_to_end_ratio_to_roofline_bytes_read": end_to_end / (bandwidth / read_bytes),
        "engine_start_s": load_s,
        "graph_capture_s": report.seconds if report else None,
        "graph_capture_MiB": report.memory_bytes / 2**20 if report else None,
        "graph_pool_MiB": getattr(report, "pool_bytes", 0) / 2**20 if report else None,
    }
    return result


def hf_generate_rate(model_dir: str, batch: int, input_len: int, output_len: int) -> float:
    """Output tokens/s of HF transformers ``generate`` (eager, bf16, random weights) at one batch size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).eval()
    ids = torch.randint(1000, 40000, (batch, input_len), device="cuda")
    kwargs = {"max_new_tokens": output_len, "min_new_tokens": output_len, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(ids[:2, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    produced = (out.shape[1] - input_len) * batch
    del model
    return produced / seconds


def cmd_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from engine.sampling.params import SamplingParams

    if args.unpaired:
        override_tuning(decode_paired_fp8=None)
    extra = (use_decode_kernel_from(args.decode_kernel_from),) if args.decode_kernel_from else ()

    llm = make_llm(
        args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        memory_fraction=args.memory_fraction, max_model_len=1024,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        enable_dbo=args.enable_dbo, dbo_decode_token_threshold=args.dbo_decode_token_threshold,
    )  # fmt: skip
    rng = random.Random(0)
    prompts = [[rng.randint(1000, 40000) for _ in range(512)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    from engine_plugin_sdk.gpu.triton_kernels.variants import watch_compiles

    with watch_compiles(extra) as compiled_during_run:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # two runs that should give the same greedy tokens (a kernel variant against the default) compare this
    digest = hashlib.sha256(str([list(o.outputs[0].token_ids) for o in outputs]).encode()).hexdigest()[:16]
    result: dict[str, Any] = {
        "output_tokens_sha256": digest,
        "num_prompts": args.num_prompts,
        "engine_seconds": seconds,
        "engine_output_tok_s": out_tokens / seconds,
        "engine_total_tok_s": (out_tokens + 512 * args.num_prompts) / seconds,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "memory_fraction": args.memory_fraction,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "enable_dbo": args.enable_dbo,
        "unpaired": args.unpaired,
        "decode_kernel_from": args.decode_kernel_from,
        "dbo_decode_token_threshold": args.dbo_decode_token_threshold,
        "dbo_attention_sms": os.environ.get("ENGINE_NVIDIA_DBO_ATTENTION_SMS", "0"),
        "kv_blocks": llm.llm_engine.block_manager.num_total_blocks,
        # Triton kernels compiled inside the timed run (each a stall of about a second); should be none
        "kernels_compiled_during_run": {name: len(keys) for name, keys in compiled_during_run.items()} or "none",
        "kernel_variants_compiled_during_run": compiled_during_run,
    }
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()
    result.update(cmd_hf(args))
    hf = [v for k, v in result.items() if k.startswith("hf_output_tok_s") and isinstance(v, float)]
    if hf:  # `--hf-batch` with no sizes measures the engine alone
        result["hf_best_output_tok_s"] = max(hf)
        result["engine_over_hf"] = result["engine_output_tok_s"] / max(hf)
    return result


def cmd_hf(args: argparse.Namespace) -> dict[str, Any]:
    """HF transformers alone at each ``--hf-batch`` size (its best batch size for (b))."""
    result: dict[str, Any] = {}
    for batch in args.hf_batch:
        try:
            result[f"hf_output_tok_s_batch{batch}"] = hf_generate_rate(args.model, batch, 512, 256)
        except torch.OutOfMemoryError:
            result[f"hf_output_tok_s_batch{batch}"] = "out of memory"
        gc.collect()
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("decode", "throughput", "hf"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--json", default=None)
        if name != "hf":
            p.add_argument("--decode-kernel-from", default=None,
                           help="a kernel module of an earlier commit whose decode attention runs instead (A/B)")
        if name == "hf":
            p.add_argument("--hf-batch", type=int, nargs="+", default=[256, 512, 768])
        if name == "decode":
            p.add_argument("--late-kv", action="store_true",
                           help="decode attention reads the cache only after its PDL wait (the A/B)")
            p.add_argument("--merge-last", action="store_true",
                           help="split decode attention merged by its last split program, not a merge kernel (the A/B)")
            p.add_argument("--gemv-tiles", default=None,
                           help="the batch-1 GEMVs' tiles for this run (use_gemv_tiles: narrow=bn,bk,warps,stages,prefetch+...)")
            p.add_argument("--min-split-keys", type=int, default=None,
                           help="KernelTuning.decode_min_split_keys for this run (the A/B)")
        if name == "throughput":
            p.add_argument("--num-prompts", type=int, default=1000)
            # every request fits at once (1000 x 768 tokens of KV is ~100 GB) and prefill runs in
            # 16k-token steps: fewer, larger steps spend less host time per token
            p.add_argument("--max-num-seqs", type=int, default=1024)
            p.add_argument("--max-num-batched-tokens", type=int, default=16384)
            p.add_argument("--memory-fraction", type=float, default=0.9)
            # HF's rate keeps rising with the batch up to what fits: 2,801 / 3,894 / 4,982 output tok/s at
            # 256 / 512 / 768 on an H200 (fifth session); 1000 runs out of memory there
            p.add_argument("--hf-batch", type=int, nargs="*", default=[256, 512, 768])
            # the FP8 options (W8A8 projections, FP8 KV cache); the figure is plain bf16
            p.add_argument("--quantization", default="auto", choices=["auto", "fp8"])
            p.add_argument("--kv-cache-dtype", default="auto")
            # dual-batch overlap (SMs left to attention: ENGINE_NVIDIA_DBO_ATTENTION_SMS)
            p.add_argument("--enable-dbo", action="store_true")
            p.add_argument("--unpaired", action="store_true",
                           help="decode programs of one KV head over an FP8 cache (the default before pairing)")
            p.add_argument("--dbo-decode-token-threshold", type=int, default=256)
    args = parser.parse_args()
    result = {"decode": cmd_decode, "throughput": cmd_throughput, "hf": cmd_hf}[args.command](args)
    for key, value in result.items():
        print(f"{key:36s} {value:.4g}" if isinstance(value, float) else f"{key:36s} {value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

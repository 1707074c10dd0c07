"""Mixtures of experts on the H200: the Triton MoE kernels, and a Qwen3-30B-A3B-shaped model (dummy bf16 weights).

Subcommands (repository root, on the device machine after ``source benchmarks/nvidia_h200_setup.sh``):

- ``kernels``: one Qwen3-30B-A3B MoE layer (128 experts, top 8, hidden 2048, expert width 768) at several
  token counts: each kernel path (GEMV, grouped GEMM with a few tiles) checked against the per-expert torch
  path (``reference_fused_moe`` over cuBLAS) and timed, with the bandwidth of the expert bytes it must read.
- ``decode``: batch-1 decode with CUDA graphs against the roofline of the bytes a step reads: attention and
  norms, the router, the ``top_k`` experts a token picks (not all 128), the LM head.
- ``throughput``: 1000 prompts x (512 in / 256 out) offline, then HF transformers ``generate`` at each
  ``--hf-batch`` size, in the same run.

    python benchmarks/nvidia_h200_moe.py kernels
    python benchmarks/nvidia_h200_moe.py decode --tokenizer .nvcarry/llama3-8b-dummy
    python benchmarks/nvidia_h200_moe.py throughput --tokenizer .nvcarry/llama3-8b-dummy --hf-batch 64 128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

#: Qwen3-30B-A3B's published config.json (the shapes; weights are random)
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}  # fmt: skip
E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def timed(fn: Any, repeats: int = 10, inner: int = 20) -> float:
    """Median seconds of one ``fn()`` on the GPU, replayed ``inner`` times per CUDA graph (no host launch
    cost, as inside the engine's decode graphs; with PDL where the GPU has it, as there)."""
    from engine_plugin_sdk.gpu.triton_kernels import pdl

    pdl.configure(torch.cuda.get_device_capability() >= (9, 0))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with pdl.for_capture():
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return sorted(times)[len(times) // 2]


def cmd_kernels(args: argparse.Namespace) -> dict[str, Any]:
    from triton.runtime.errors import OutOfResources

    from engine.interfaces.moe import ExpertWeights, reference_fused_moe
    from engine_plugin_nvidia.gemm import CudaGemmBackend
    from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import MoeTiles, fused_moe, moe_topk

    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, HIDDEN, INTER, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    per_expert = ExpertWeights(list(gate_up.unbind(0)), list(down.unbind(0)))
    gemm = CudaGemmBackend("cuda")
    results: dict[str, Any] = {}
    expert_bytes = (3 * INTER * HIDDEN) * 2
    # the pieces of a batch-1 MoE layer besides the experts
    x1 = torch.randn(1, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    router = torch.randn(E, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    logits1 = gemm.linear(x1, router)
    results["router_us"] = 1e6 * timed(lambda: gemm.linear(x1, router))
    results["topk_us"] = 1e6 * timed(lambda: moe_topk(logits1, TOP_K, True))
    print(f"batch 1: router GEMM {results['router_us']:.1f} us, top-k kernel {results['topk_us']:.1f} us", flush=True)
    variants = {f"gemv{gu}{dn}p{pf}": MoeTiles(gemv_max_slots=1 << 30, gate_up_gemv=gu, down_gemv=dn, down_prefetch=pf)
                for gu in args.gate_up_gemv for dn in args.down_gemv for pf in args.down_prefetch}  # fmt: skip
    if args.down_at_once:
        # the down GEMV with a token's experts as a tile dimension (MoeTiles.down_experts_at_once)
        variants |= {f"gemv{gu}{dn}all": MoeTiles(gemv_max_slots=1 << 30, gate_up_gemv=gu, down_gemv=dn,
                                                  down_experts_at_once=True)
                     for gu in args.gate_up_gemv for dn in args.down_gemv}  # fmt: skip
    for bm, bn, bk, warps, stages in args.tiles:
        variants[f"gemm{bm}x{bn}x{bk}w{warps}s{stages}"] = MoeTiles(
            gemv_max_slots=0, gemm=((0, bm, bn, bk, warps, stages),)
        )
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
        logits = torch.randn(tokens, E, device="cuda", generator=gen, dtype=torch.float32)
        weights, ids = moe_topk(logits, TOP_K, True)
        unique = int(torch.unique(ids).numel())
        want = reference_fused_moe(gemm, x, per_expert, weights, ids).float()
        row: dict[str, Any] = {"unique_experts": unique}
        for name, tiles in variants.items():
            if name.startswith("gemv") and tokens * TOP_K > 512:
                continue
            try:
                got = fused_moe(x, gate_up, down, weights, ids, tiles).float()
            except OutOfResources:
                continue
            err = float(((got - want).abs().max() / want.abs().max()).item())
            sec = timed(lambda x=x, w=weights, i=ids, t=tiles: fused_moe(x, gate_up, down, w, i, t))
            row[name] = {"us": 1e6 * sec, "TBps_unique_experts": unique * expert_bytes / sec / 1e12, "rel_err": err}
        ranked = sorted((v["us"], k) for k, v in row.items() if isinstance(v, dict))
        worst_err = max(v["rel_err"] for v in row.values() if isinstance(v, dict))
        print(f"T={tokens:5d} unique={unique:3d} max rel err {worst_err:.1e}  "
              + "  ".join(f"{k} {us:.1f}us {row[k]['TBps_unique_experts']:.2f}TB/s" for us, k in ranked[:4]),
              flush=True)  # fmt: skip
        results[f"tokens_{tokens}"] = row
    return results


def cmd_expert_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """One Qwen3-30B-A3B MoE layer with its experts in each ``--experts`` form, through the backend's
    ``prepare_experts`` / ``fused_moe`` (grouped-integer experts: their GEMV and grouped GEMM), at each token count and
    GEMV tile: microseconds, and the bandwidth of the distinct chosen experts' stored bytes."""
    from nvidia_h200_quantized import random_weight

    from engine_plugin_nvidia.gemm import CudaGemmBackend
    from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import MoeTiles, moe_topk

    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict[str, Any] = {}
    for variant in args.experts:
        kind = EXPERT_KINDS[variant]
        if kind is None:
            gate_up = [torch.randn(2 * INTER, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
                       for _ in range(E)]  # fmt: skip
            down = [torch.randn(HIDDEN, INTER, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(E)]
        else:
            gate_up = [random_weight(kind, 2 * INTER, HIDDEN, "cuda", gen) for _ in range(E)]
            down = [random_weight(kind, HIDDEN, INTER, "cuda", gen) for _ in range(E)]
        gemm = CudaGemmBackend("cuda")
        experts = gemm.prepare_experts(gate_up, down, "bfloat16")
        per_expert = (expert_bytes(experts.gate_up) + expert_bytes(experts.down)) / E
        del gate_up, down
        for tokens in args.tokens:
            x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
            logits = torch.randn(tokens, E, device="cuda", generator=gen, dtype=torch.float32)
            weights, ids = moe_topk(logits, TOP_K, True)
            unique = int(torch.unique(ids).numel())
            row = {}
            for gu in args.gate_up_gemv:
                for dn in args.down_gemv:
                    gemm.moe_tiles = MoeTiles(gate_up_gemv=gu, down_gemv=dn)
                    sec = timed(lambda x=x, w=weights, i=ids, g=gemm, e=experts: g.fused_moe(x, e, w, i))
                    row[f"gemv{gu}{dn}"] = {"us": 1e6 * sec, "TBps": unique * per_expert / sec / 1e12}
            best = min(row.items(), key=lambda kv: kv[1]["us"])
            print(f"{variant:12s} T={tokens:4d} unique={unique:3d} {per_expert * unique / 1e6:6.1f} MB  best {best[0]} "
                  f"{best[1]['us']:.1f} us {best[1]['TBps']:.2f} TB/s  | "
                  + "  ".join(f"{k} {v['us']:.1f}" for k, v in row.items()), flush=True)  # fmt: skip
            results[f"{variant}_tokens_{tokens}"] = row
        del experts
        torch.cuda.empty_cache()
    return results


def moe_model_folder(tokenizer: str, out: str) -> str:
    from nvidia_h200_dense import tokenizer_only

    folder = tokenizer_only(tokenizer, out)
    Path(folder, "config.json").write_text(json.dumps(QWEN3_30B_A3B), encoding="utf-8")
    return folder


def step_bytes(llm: Any) -> tuple[int, int]:
    """(all parameter bytes, bytes a batch-1 decode step reads: every layer tensor, the router, the
    ``top_k`` chosen experts of each MoE layer, the final norm and the LM head; not the embedding table)."""
    model = llm.llm_engine.model
    total = model.embed_tokens.numel() * model.embed_tokens.element_size()
    read = 0
    for layer in model.layers:
        for field in dataclasses.fields(layer):
            t = getattr(layer, field.name)
            if isinstance(t, torch.Tensor):
                read += t.numel() * t.element_size()
        moe = layer.moe
        if moe is not None:
            experts = moe.experts
            stacked = sum(expert_bytes(t) for t in (experts.gate_up, experts.down))
            total += stacked
            read += stacked * moe.top_k // experts.num_experts + moe.router.numel() * moe.router.element_size()
    read += model.lm_head.numel() * model.lm_head.element_size() + model.final_norm.numel() * 2
    return total + read, read


def expert_bytes(stack: Any) -> int:
    """Device bytes of one projection's stacked experts: a tensor, or grouped-integer codes with their scales."""
    if isinstance(stack, torch.Tensor):
        return stack.numel() * stack.element_size()
    if isinstance(stack, list):  # a backend that keeps its experts apart (the CPU's)
        return sum(expert_bytes(part) for part in stack)
    return int(getattr(stack, "nbytes", 0))


#: ``--experts`` variant -> the dummy loader's kind for every expert matrix (None: bf16), as a pre-quantized MoE
#: checkpoint holds them (GPTQ int4 with groups of 128, one zero point; AWQ-style zero points; GGUF Q4_K / Q8_0),
#: the rest of the model bf16
EXPERT_KINDS = {"bf16": None, "int4_g128": "int4_g128", "int4_g128_zp": "int4_g128_zp", "gguf_q4_k": "gguf_q4_k",
                "gguf_q8_0": "gguf_q8_0"}  # fmt: skip


def experts_as(variant: str) -> Any:
    """A context in which ``load_format="dummy"`` draws the experts as ``variant``'s kind."""
    from nvidia_h200_quantized import dummy_as

    kind = EXPERT_KINDS[variant]
    return dummy_as(lambda name, layers: kind if ".experts." in name else None)


def make_moe_llm(folder: str, **kwargs: Any) -> Any:
    from engine import LLM

    return LLM(model=folder, device="cuda", dtype="bfloat16", load_format="dummy", **kwargs)


def cmd_decode(args: argparse.Namespace) -> dict[str, Any]:
    from nvidia_h200 import copy_bandwidth, decode_rate, override_tuning
    from nvidia_moe_variants import parse_moe_tiles, use_l2_ahead, use_routing_kernel_from, with_tiles

    use_l2_ahead()  # a no-op unless ENGINE_BENCH_L2_AHEAD=1 (e.g. through --env-ab)
    bandwidth = copy_bandwidth()
    if args.merge_last:
        # split decode attention merged by its last program (KernelTuning.decode_merge_last): the A/B
        override_tuning(decode_merge_last=True)
    if args.late_kv:
        override_tuning(decode_early_kv=False)
    if args.decode_kernel_from:
        from nvidia_h200 import use_decode_kernel_from

        use_decode_kernel_from(args.decode_kernel_from)  # an earlier commit's decode attention kernel: the A/B
    if args.routing_kernel_from:
        use_routing_kernel_from(args.routing_kernel_from)  # an earlier commit's routing kernel: the A/B
    overrides: dict[str, Any] = {}
    if args.down_prefetch is not None:
        overrides["down_prefetch"] = args.down_prefetch  # the down GEMV's PDL prefetch depth: the A/B
    if args.down_at_once:
        overrides["down_experts_at_once"] = True
    if args.down_gemv is not None:
        overrides["down_gemv"] = args.down_gemv
    if overrides or args.moe_tiles_ab:
        from engine_plugin_sdk.gpu.triton_kernels import moe_grouped_int_launchers, moe_launchers

        # bf16 / FP8 experts and packed integer experts alike; each --moe-tiles-ab run updates `overrides`
        for module, name in ((moe_launchers, "fused_moe"), (moe_grouped_int_launchers, "fused_moe_grouped_int")):
            setattr(module, name, with_tiles(getattr(module, name), overrides))
    fixed_overrides = dict(overrides)
    from nvidia_h200 import batched_decode_rate, release, use_gemv_tiles

    results: dict[str, Any] = {"copy_bandwidth_TBps": bandwidth / 1e12}
    with tempfile.TemporaryDirectory() as tmp:
        folder = moe_model_folder(args.tokenizer, os.path.join(tmp, "qwen3-30b-a3b"))
        runs = [
            (variant, keys, tiles, last, moe_tiles, env)
            for env in (args.env_ab or [None])
            for moe_tiles in (args.moe_tiles_ab or [None])
            for last in (args.merge_last_ab or [None])
            for tiles in (args.gemv_tiles or [None])
            for keys in (args.min_split_keys or [None])
            for variant in args.experts
        ]
        for run, (variant, keys, tiles, last, moe_tiles, env) in enumerate(runs):
            if env is not None:
                # plugin settings read when an engine's backend is made (NAME=VALUE+NAME=VALUE): the A/B
                os.environ.update(dict(item.split("=", 1) for item in env.split("+")))
            if moe_tiles is not None:
                # the MoE kernels' tiles (MoeTiles fields over the backend's): the A/B, one engine each
                overrides.clear()
                overrides.update(fixed_overrides, **parse_moe_tiles(moe_tiles))
            if tiles is not None:
                use_gemv_tiles(tiles)  # the batch-1 GEMVs' tiles: the A/B
            if last is not None:
                # split decode attention merged by its last program or by the merge kernel: the A/B
                override_tuning(decode_merge_last=bool(last))
            if keys is not None:
                # no decode split under this many keys (KernelTuning.decode_min_split_keys): the A/B
                override_tuning(decode_min_split_keys=keys)
            t0 = time.perf_counter()
            with experts_as(variant):
                llm = make_moe_llm(folder, max_num_seqs=8, kv_cache_memory_bytes=8 << 30, max_model_len=4096)
            load_s = time.perf_counter() - t0
            all_bytes, read = step_bytes(llm)
            rate = decode_rate(llm)
            batched = {n: batched_decode_rate(llm, n) for n in args.decode_batch}
            long_rate = decode_rate(llm, prompt_len=args.long_prompt, new_tokens=128) if args.long_prompt else None
            if args.profile:
                profile_decode(llm)
            llm.shutdown()
            del llm
            release()
            roofline = bandwidth / read
            name = variant + ("" if keys is None else f"_min_split_keys={keys}") + ("" if tiles is None else f"_gemv={tiles}")
            name += "" if last is None else f"_merge_last={last}"
            name += "" if moe_tiles is None else f"_moe_tiles={moe_tiles}_run{run}"  # a variant may run twice
            name += "" if env is None else f"_{env}_run{run}"
            results[name] = {
                "GB_all": all_bytes / 1e9, "GB_read_per_step": read / 1e9, "roofline_tok_s": roofline,
                "decode_tok_s": rate, "ratio_to_roofline": rate / roofline, "load_s": load_s,
                "batched_tok_s": batched, "long_prompt": args.long_prompt, "long_prompt_decode_tok_s": long_rate,
            }  # fmt: skip
            print(f"qwen3-30b-a3b experts {name}: {all_bytes / 1e9:.1f} GB, reads {read / 1e9:.2f} GB/step, "
                  f"roofline {roofline:.0f} tok/s, decode {rate:.1f} tok/s = {rate / roofline:.3f} of it"
                  + "".join(f", {n} sequences {r:.1f} tok/s" for n, r in batched.items())
                  + (f", after {args.long_prompt} tokens {long_rate:.1f} tok/s" if long_rate else "")
                  + f" (load {load_s:.0f} s)", flush=True)  # fmt: skip
    return results


def profile_decode(llm: Any, steps: int = 32) -> None:
    """GPU time by kernel over ``steps`` batch-1 decode steps (in the decode graphs), per step."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    prompt = list(range(1000, 1128))
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows)
    print(f"per decode step: {total / steps:.0f} us of GPU time in kernels", flush=True)
    for e in rows[:26]:
        print(f"  {e.device_time_total / steps:8.1f} us  {e.count / steps:5.1f}x  {e.key[:90]}", flush=True)


def cmd_throughput(args: argparse.Namespace) -> dict[str, Any]:
    import gc
    import random

    from nvidia_h200 import hf_generate_rate

    from engine import SamplingParams

    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = moe_model_folder(args.tokenizer, os.path.join(tmp, "qwen3-30b-a3b"))
        llm = make_moe_llm(folder, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           memory_fraction=0.9, max_model_len=1024)  # fmt: skip
        rng = random.Random(0)
        prompts = [[rng.randint(1000, 40000) for _ in range(512)] for _ in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        from engine_plugin_sdk.gpu.triton_kernels.variants import watch_compiles

        with watch_compiles() as compiled:
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        # Triton kernels compiled inside the timed run (each a stall of a second or more); should be none
        result.update({"num_prompts": args.num_prompts, "engine_seconds": seconds,
                       "engine_output_tok_s": produced / seconds, "max_num_seqs": args.max_num_seqs,
                       "kernel_variants_compiled_during_run": compiled})  # fmt: skip
        print(f"engine: {args.num_prompts} x (512 in / 256 out) in {seconds:.1f} s = {produced / seconds:.0f} out tok/s"
              f"; kernels compiled during the run: {({k: len(v) for k, v in compiled.items()}) or 'none'}",
              flush=True)  # fmt: skip
        del llm, outputs
        gc.collect()
        torch.cuda.empty_cache()
        for batch in args.hf_batch:
            try:
                rate = hf_generate_rate(folder, batch, 512, args.hf_output_len)
            except torch.OutOfMemoryError:
                rate = "out of memory"
            result[f"hf_output_tok_s_batch{batch}"] = rate
            print(f"HF batch {batch}: {rate} out tok/s", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    hf = [v for k, v in result.items() if k.startswith("hf_output_tok_s") and isinstance(v, float)]
    if hf:
        result["engine_over_hf"] = result["engine_output_tok_s"] / max(hf)
        print(f"engine / best HF = {result['engine_over_hf']:.2f}", flush=True)
    return result


def main() -> None:
    from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import MoeTiles

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    k = sub.add_parser("kernels")
    ints = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    k.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096])
    k.add_argument("--tiles", type=ints, nargs="*",
                   default=[(16, 64, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3)],
                   help="grouped-GEMM tiles as block_m,block_n,block_k,warps,stages")
    k.add_argument("--gate-up-gemv", type=ints, nargs="+", default=[(2, 1024, 4)], help="block_n,block_k,warps")
    k.add_argument("--down-gemv", type=ints, nargs="+", default=[(4, 1024, 4)], help="block_n,block_k,warps")
    k.add_argument("--down-prefetch", type=int, nargs="+", default=[MoeTiles().down_prefetch],
                   help="experts whose first down tile loads before the PDL wait")
    k.add_argument("--down-at-once", action="store_true",
                   help="also each down tile with a token's experts gathered together (MoeTiles.down_experts_at_once)")
    ek = sub.add_parser("expert-kernels")
    ek.add_argument("--experts", nargs="+", default=["bf16", "int4_g128", "gguf_q4_k"], choices=list(EXPERT_KINDS))
    ek.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 64, 256])
    ek.add_argument("--gate-up-gemv", type=ints, nargs="+", default=[(2, 1024, 4)], help="block_n,block_k,warps")
    ek.add_argument("--down-gemv", type=ints, nargs="+", default=[(4, 1024, 4)], help="block_n,block_k,warps")
    for name in ("decode", "throughput"):
        p = sub.add_parser(name)
        p.add_argument("--tokenizer", required=True, help="a folder holding a HF tokenizer (its other files are ignored)")
        if name == "decode":
            p.add_argument("--profile", action="store_true", help="then GPU time by kernel of eager decode steps")
            p.add_argument("--experts", nargs="+", default=["bf16"], choices=list(EXPERT_KINDS),
                           help="the experts' form, each variant its own engine in turn (the rest stays bf16)")
            p.add_argument("--decode-batch", type=int, nargs="*", default=[], help="also decode this many sequences")
            p.add_argument("--down-prefetch", type=int, default=None,
                           help="experts whose first down tile loads before the PDL wait (default: the tiles')")
            p.add_argument("--down-at-once", action="store_true",
                           help="the down GEMV gathers a token's experts together (MoeTiles.down_experts_at_once)")
            p.add_argument("--down-gemv", type=ints, default=None, help="the down GEMV's block_n,block_k,warps")
            p.add_argument("--decode-kernel-from", default=None,
                           help="the decode attention kernel of this file (an earlier commit's) instead of the tree's")
            p.add_argument("--routing-kernel-from", default=None,
                           help="the routing kernel (moe_topk_kernel) of this file (an earlier commit's) instead of the tree's")
            p.add_argument("--late-kv", action="store_true",
                           help="decode attention reads the cache only after its PDL wait (the A/B)")
            p.add_argument("--merge-last", action="store_true",
                           help="split decode attention merged by its last split program, not a merge kernel")
            p.add_argument("--merge-last-ab", type=int, nargs="*", default=[],
                           help="each run's KernelTuning.decode_merge_last (0 / 1, the A/B), one engine each")
            p.add_argument("--moe-tiles-ab", nargs="*", default=[],
                           help="each run's MoE tiles over the backend's (default, or down_gemv=4x1024x4+"
                           "down_prefetch=0), one engine each in this process")
            p.add_argument("--env-ab", nargs="*", default=[],
                           help="each run's plugin settings as NAME=VALUE+NAME=VALUE (e.g. ENGINE_NVIDIA_LINEAR_NORM=0 "
                           "ENGINE_NVIDIA_LINEAR_NORM=16,256,4), one engine each in this process")
            p.add_argument("--min-split-keys", type=int, nargs="*", default=[],
                           help="each run's KernelTuning.decode_min_split_keys (the A/B), one engine each")
            p.add_argument("--gemv-tiles", nargs="*", default=[],
                           help="each run's batch-1 GEMV tiles (nvidia_h200.use_gemv_tiles: default, or "
                           "narrow=bn,bk,warps,stages,prefetch+wide=...), one engine each")
            p.add_argument("--long-prompt", type=int, default=0,
                           help="also batch-1 decode 128 tokens after a prompt of this many tokens")
        if name == "throughput":
            p.add_argument("--num-prompts", type=int, default=1000)
            p.add_argument("--max-num-seqs", type=int, default=256)
            p.add_argument("--max-num-batched-tokens", type=int, default=8192)
            p.add_argument("--hf-batch", type=int, nargs="*", default=[64, 128])
            p.add_argument("--hf-output-len", type=int, default=256)
    for p in sub.choices.values():
        p.add_argument("--json", default=None)
    args = parser.parse_args()
    commands = {"kernels": cmd_kernels, "expert-kernels": cmd_expert_kernels, "decode": cmd_decode,
                "throughput": cmd_throughput}  # fmt: skip
    result = commands[args.command](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()

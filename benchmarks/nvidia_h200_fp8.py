"""What the FP8 options buy on an H200, kernel by kernel (diagnostic; see BENCHMARKS.md).

- GEMMs at Llama-3-8B shapes: bf16 (cuBLAS) against W8A8 (the fused per-token activation quantizer plus
  torch's row-wise scaled matmul), at a prefill step's rows and a large decode batch's.
- Decode attention over a bf16 against an FP8 KV cache: one decode step of a large batch.

Usage: python benchmarks/nvidia_h200_fp8.py [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import torch

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _median_seconds(fn: Any, repeats: int = 10, calls: int = 10) -> float:
    """Median device seconds of one call, from CUDA graphs of ``calls`` calls (no host time between)."""
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def gemm_table(rows_list: list[int]) -> dict[str, Any]:
    from engine.loader.fp8 import quantize_fp8_per_channel
    from engine_plugin_nvidia.gemm import CudaGemmBackend

    gemm = CudaGemmBackend("cuda", fp8=True)
    out: dict[str, Any] = {}
    print(f"{'shape':10s} {'rows':>6s} {'bf16 TFLOP/s':>13s} {'W8A8 TFLOP/s':>13s} {'speed-up':>9s}")
    for rows in rows_list:
        total_bf16 = total_fp8 = 0.0
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w8 = gemm.prepare_weight(quantize_fp8_per_channel(w), torch.bfloat16)
            t16 = _median_seconds(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            t8 = _median_seconds(lambda x=x, w8=w8: gemm.linear(x, w8))
            flop = 2 * rows * n * k
            total_bf16 += t16
            total_fp8 += t8
            out[f"{name}_{rows}"] = {"bf16_s": t16, "w8a8_s": t8}
            print(f"{name:10s} {rows:6d} {flop / t16 / 1e12:13.0f} {flop / t8 / 1e12:13.0f} {t16 / t8:9.2f}")
            del w, w8, x
        out[f"layer_{rows}"] = {"bf16_s": total_bf16, "w8a8_s": total_fp8}
        print(f"{'one layer':10s} {rows:6d} {'':13s} {'':13s} {total_bf16 / total_fp8:9.2f}")
    return out


def decode_attention_table(num_seqs: int, context: int) -> dict[str, Any]:
    from engine_plugin_nvidia.platform import CudaPlatform
    from engine_plugin_sdk.gpu.triton_kernels import launchers

    tuning = CudaPlatform().kernel_tuning()
    heads, kv_heads, dim, block = 32, 8, 128, 16
    blocks_per_seq = -(-context // block)
    num_blocks = num_seqs * blocks_per_seq
    tables = torch.arange(num_blocks, device="cuda", dtype=torch.int32).reshape(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, device="cuda", dtype=torch.int32)
    query = torch.randn(num_seqs, heads, dim, device="cuda", dtype=torch.bfloat16)
    out: dict[str, Any] = {}
    variants = [("bf16", torch.bfloat16, None)] + [
        (f"fp8 {tiles}", torch.float8_e4m3fn, tiles)
        for tiles in [(64, 4, 2), (128, 4, 2), (128, 8, 2), (128, 4, 3), (256, 8, 2), (64, 4, 3)]
    ]
    for name, dtype, tiles in variants:
        cache = torch.randn(2, num_blocks, block, kv_heads, dim, device="cuda").to(dtype)
        res = torch.empty_like(query)
        tune = dataclasses.replace(tuning, decode_fp8=tiles)
        splits = tune.decode_splits(num_seqs, kv_heads, context)
        seconds = _median_seconds(
            lambda res=res, cache=cache, splits=splits, tune=tune: launchers.paged_decode(
                res, query, cache, tables, seq_lens, dim**-0.5, splits, tune
            )
        )
        nbytes = cache.numel() * cache.element_size()
        out[name] = {"seconds": seconds, "tb_s": nbytes / seconds / 1e12}
        print(f"decode attention, {num_seqs} x {context} tokens, {name} cache: {seconds * 1e3:.3f} ms, "
              f"{nbytes / seconds / 1e12:.2f} TB/s of cache read")
        del cache
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = {"gemm": gemm_table([16384, 1024]), "decode_attention": decode_attention_table(1024, 640)}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

"""The Triton prefill attention kernel's tiles on the H200, swept on two workloads: an encoder step (bge-large:
256 prompts of 128 tokens, 16 heads of 64, non-causal) and a decoder prefill (Llama-3-8B: 16 prompts of 512
tokens, 32 query / 8 KV heads of 128, causal). Each variant is checked against the default tiles' output
(bf16, max |diff|), then timed in a CUDA graph; prints µs per call and TFLOP/s.

    python benchmarks/nvidia_h200_prefill_tiles.py [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
from nvidia_h200_fp8 import _median_seconds

from engine_plugin_sdk.gpu.triton_kernels import launchers
from engine_plugin_sdk.gpu.triton_kernels.launch import AttentionTiles, KernelTuning

WORKLOADS = {
    "encoder bge-large": dict(seqs=256, length=128, heads=16, kv_heads=16, head_dim=64, causal=False),
    "decoder llama3-8b": dict(seqs=16, length=512, heads=32, kv_heads=8, head_dim=128, causal=True),
}
VARIANTS = [
    AttentionTiles(64, 64, 4, 3), AttentionTiles(64, 64, 4, 2), AttentionTiles(128, 64, 4, 3),
    AttentionTiles(128, 64, 8, 3), AttentionTiles(128, 32, 4, 3), AttentionTiles(64, 32, 4, 3),
    AttentionTiles(64, 128, 4, 2), AttentionTiles(128, 128, 8, 2), AttentionTiles(32, 64, 4, 3),
]
BLOCK = 16


def make_inputs(seqs: int, length: int, heads: int, kv_heads: int, head_dim: int, **_: Any) -> dict[str, Any]:
    dev, dt = "cuda", torch.bfloat16
    tokens = seqs * length
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(tokens, heads, head_dim, device=dev, dtype=dt, generator=gen)
    k = torch.randn(tokens, kv_heads, head_dim, device=dev, dtype=dt, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, device=dev, dtype=dt, generator=gen)
    blocks_per_seq = length // BLOCK
    cache = torch.zeros(2, seqs * blocks_per_seq, BLOCK, kv_heads, head_dim, device=dev, dtype=dt)
    tables = torch.arange(seqs * blocks_per_seq, device=dev, dtype=torch.int32).view(seqs, blocks_per_seq)
    slots = torch.arange(tokens, device=dev, dtype=torch.int64)
    launchers.write_kv(k, v, cache, slots)
    return {
        "q": q, "k": k, "v": v, "cache": cache, "tables": tables, "slots": slots,
        "seq_lens": torch.full((seqs,), length, device=dev, dtype=torch.int32),
        "qsl": torch.arange(0, tokens + 1, length, device=dev, dtype=torch.int32),
    }  # fmt: skip


def run(inputs: dict[str, Any], tuning: KernelTuning, length: int, causal: bool, head_dim: int) -> torch.Tensor:
    out = torch.empty_like(inputs["q"])
    launchers.paged_prefill(
        out, inputs["q"], inputs["cache"], inputs["tables"], inputs["seq_lens"], inputs["qsl"], length,
        head_dim**-0.5, tuning, causal=causal,
    )  # fmt: skip
    return out


def graph_us(fn: Any) -> float:
    """Median µs of one call, from CUDA graphs of ten calls (``nvidia_h200_fp8``'s timer)."""
    return _median_seconds(fn, repeats=20) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from engine_plugin_nvidia.tuning import tuning_for_device

    base = tuning_for_device(interpret=False)
    results: dict[str, Any] = {}
    for name, w in WORKLOADS.items():
        inputs = make_inputs(**w)
        field = "prefill_small_head" if w["head_dim"] <= 128 else "prefill_large_head"
        reference = run(inputs, base, w["length"], w["causal"], w["head_dim"])
        flops = 4 * w["seqs"] * w["length"] ** 2 * w["head_dim"] * w["heads"] * (0.5 if w["causal"] else 1.0)
        write = graph_us(partial(launchers.write_kv, inputs["k"], inputs["v"], inputs["cache"], inputs["slots"]))
        print(f"=== {name} (default {getattr(base, field)}; write_kv {write:.1f} us)", flush=True)
        rows = {}
        for tiles in VARIANTS:
            tuning = dataclasses.replace(base, **{field: tiles})
            try:
                out = run(inputs, tuning, w["length"], w["causal"], w["head_dim"])
                diff = (out.float() - reference.float()).abs().max().item()
                us = graph_us(partial(run, inputs, tuning, w["length"], w["causal"], w["head_dim"]))
            except Exception as exc:  # a tile the compiler refuses (shared memory): reported, not fatal
                print(f"  {tiles}: failed: {str(exc).splitlines()[0][:100]}", flush=True)
                continue
            rows[str(tiles)] = {"us": us, "tflops": flops / us / 1e6, "max_diff": diff}
            print(f"  {tiles}: {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s  max diff {diff:.2e}", flush=True)
        results[name] = {"write_kv_us": write, "variants": rows}
        del inputs
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()

"""What each graph node of a batch-1 decode step costs on the H200 (dummy weights, CUDA graphs with PDL).

Subcommands (repository root, on the device machine after ``source benchmarks/nvidia_h200_setup.sh``):

- ``segment``: one layer's attention segment, qkv GEMV -> decode attention (and its split merge) -> o_proj
  GEMV, replayed in a graph, against the two GEMVs alone, by split count: Qwen3-30B-A3B heads (32 query, 4
  KV, per-head norms) and Llama-3-8B heads (32 / 8), contexts of 256 and 2,048 tokens.
- ``decode``: batch-1 decode steps of a Qwen3-30B-A3B-shaped model (``--model llama`` for the Llama-3-8B
  folder of ``--tokenizer``) at 128- and 1,024-token prompts, optionally with kernels taken out to time them
  (``--without topk``: a fixed routing, the router's logits unread; ``--without norms``: the residual norms
  return their input) or with at most ``--max-splits`` decode splits. The removals give wrong tokens on
  purpose: they time a node, nothing else.

    python benchmarks/nvidia_h200_decode_nodes.py segment
    python benchmarks/nvidia_h200_decode_nodes.py decode --tokenizer .nvcarry/llama3-8b-dummy --without topk
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

HIDDEN, HEAD_DIM, BLOCK_SIZE = 2048, 128, 16


def segment_us(q_heads: int, kv_heads: int, ctx: int, splits: int, head_norm: bool, attention: bool) -> float:
    """Microseconds of one attention segment (or of its two GEMVs alone), 48 of them in one graph."""
    from nvidia_h200_moe import timed

    import engine_plugin_nvidia.tuning as nvidia_tuning
    from engine.interfaces.attention import HeadNorm
    from engine_plugin_sdk.gpu.triton_kernels import gemv_launchers, launchers

    dev, dt = "cuda", torch.bfloat16
    tuning = nvidia_tuning.tuning_for_device(False)
    qkv_w = torch.randn((q_heads + 2 * kv_heads) * HEAD_DIM, HIDDEN, device=dev, dtype=dt) * 0.02
    o_w = torch.randn(HIDDEN, q_heads * HEAD_DIM, device=dev, dtype=dt) * 0.02
    x = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    blocks = 4096
    cache = torch.randn(2, blocks, BLOCK_SIZE, kv_heads, HEAD_DIM, device=dev, dtype=dt)
    tables = torch.randperm(blocks, device=dev)[: 4096 // BLOCK_SIZE].to(torch.int32).reshape(1, -1)
    seq_lens = torch.tensor([ctx], device=dev, dtype=torch.int32)
    slot = (tables[0, (ctx - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE).reshape(1)
    table = torch.randn(8192, HEAD_DIM, device=dev, dtype=torch.float32)
    index = torch.tensor([ctx - 1], device=dev)
    norm = HeadNorm(torch.rand(HEAD_DIM, device=dev) + 0.5, torch.rand(HEAD_DIM, device=dev) + 0.5, 1e-6)
    out = torch.empty(1, q_heads, HEAD_DIM, device=dev, dtype=dt)
    q_end, k_end = q_heads * HEAD_DIM, (q_heads + kv_heads) * HEAD_DIM

    def step() -> None:
        y = gemv_launchers.gemv(x, qkv_w)
        attended = y[:, :q_end]
        if attention:
            q = y[:, :q_end].view(1, q_heads, HEAD_DIM)
            k, v = y[:, q_end:k_end].view(1, kv_heads, HEAD_DIM), y[:, k_end:].view(1, kv_heads, HEAD_DIM)
            launchers.paged_decode(
                out, q, cache, tables, seq_lens, HEAD_DIM**-0.5, splits, tuning, new_kv=(k, v, slot),
                rotary=(index, table), head_norm=norm if head_norm else None,
            )  # fmt: skip
            attended = out.reshape(1, -1)
        gemv_launchers.gemv(attended, o_w)

    return timed(step, repeats=10, inner=48) * 1e6


def cmd_segment(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for ctx in args.contexts:
        for name, q_heads, kv_heads, head_norm in (("qwen3-30b-a3b", 32, 4, True), ("llama-3-8b", 32, 8, False)):
            base = segment_us(q_heads, kv_heads, ctx, 1, head_norm, attention=False)
            result[f"{name} ctx{ctx} gemvs"] = base
            print(f"{name:14s} ctx {ctx:5d}  GEMVs alone {base:6.2f} us", flush=True)
            for splits in args.splits:
                t = segment_us(q_heads, kv_heads, ctx, splits, head_norm, attention=True)
                result[f"{name} ctx{ctx} splits{splits}"] = t
                print(f"{name:14s} ctx {ctx:5d}  {splits:2d} splits {t:6.2f} us (attention {t - base:5.2f})", flush=True)
    return result


def without_topk() -> None:
    """Every routing op returns the same distinct experts (no kernel): the top-k node's cost."""
    from engine_plugin_sdk.gpu.triton_kernels import moe_launchers

    kept: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def fixed(logits: torch.Tensor, top_k: int, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        key, rows = (top_k, logits.device), logits.shape[0]
        if key not in kept or kept[key][0].shape[0] < rows:  # made by the eager warm-up, before any capture
            n = max(512, rows)
            weights = torch.full((n, top_k), 1.0 / top_k, dtype=torch.float32, device=logits.device)
            ids = (torch.arange(top_k, device=logits.device) * (logits.shape[1] // top_k)).repeat(n, 1)
            kept[key] = (weights, ids.contiguous())
        weights, ids = kept[key]
        return weights[:rows], ids[:rows]

    moe_launchers.moe_topk = fixed  # type: ignore[assignment]


def without_norms() -> None:
    """The residual norms return their input (no kernel): the norm nodes' cost."""
    from engine_plugin_sdk.gpu.triton_kernels import launchers

    launchers.fused_add_rms_norm = lambda x, residual, weight, eps: (x, residual)  # type: ignore[assignment]


def cmd_decode(args: argparse.Namespace) -> dict[str, Any]:
    from nvidia_h200 import decode_rate, make_llm, override_tuning
    from nvidia_h200_moe import make_moe_llm, moe_model_folder

    if args.max_splits:
        override_tuning(max_decode_splits=args.max_splits)
    for node in args.without:
        {"topk": without_topk, "norms": without_norms}[node]()
    limits = {"max_num_seqs": 8, "kv_cache_memory_bytes": 8 << 30, "max_model_len": 4096}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "llama":
            llm = make_llm(args.tokenizer, **limits)
        else:
            llm = make_moe_llm(moe_model_folder(args.tokenizer, os.path.join(tmp, "qwen3-30b-a3b")), **limits)
        result: dict[str, Any] = {"model": args.model, "without": args.without, "max_splits": args.max_splits}
        for prompt in (128, 1024):
            rate = decode_rate(llm, prompt_len=prompt)
            result[f"tok_s_prompt{prompt}"] = rate
            result[f"step_us_prompt{prompt}"] = 1e6 / rate
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("segment")
    s.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    s.add_argument("--splits", type=int, nargs="+", default=[4, 8, 16, 32])
    d = sub.add_parser("decode")
    d.add_argument("--tokenizer", required=True, help="a folder holding a HF tokenizer (the Llama-3-8B dummy's)")
    d.add_argument("--model", choices=["moe", "llama"], default="moe")
    d.add_argument("--without", choices=["topk", "norms"], nargs="*", default=[])
    d.add_argument("--max-splits", type=int, default=None)
    for p in (s, d):
        p.add_argument("--json", default=None)
    args = parser.parse_args()
    result = {"segment": cmd_segment, "decode": cmd_decode}[args.cmd](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()

"""Per-call time of the CPU attention backend for decode batches (a measurement script, not a test).

Usage: python plugins/cpu/benchmarks/bench_attention.py [--context 256] [--batches 1 32]
Defaults match SmolLM2-135M: 9 heads, 3 KV heads, head_dim 64, block size 16.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine_plugin_cpu.attention import CpuAttentionBackend
from engine_plugin_cpu.attention_plan import ChunkBudget
from engine_plugin_sdk import AttentionMetadata


def decode_case(
    batch: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    budget: ChunkBudget,
):
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 64
    backend = CpuAttentionBackend(budget=budget)
    cache = torch.randn(backend.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)).to(dtype)
    tables = torch.randperm(num_blocks)[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = [context] * batch
    pos = context - 1
    slots = (tables[:, pos // block_size].to(torch.int64) * block_size + pos % block_size).contiguous()
    md = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=slots,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=context,
        block_size=block_size,
        scale=head_dim**-0.5,
    )
    q = torch.randn(batch, heads, head_dim).to(dtype)
    k = torch.randn(batch, kv_heads, head_dim).to(dtype)
    v = torch.randn(batch, kv_heads, head_dim).to(dtype)
    return backend, q, k, v, cache, md


def time_calls(fn, repeats: int, rounds: int = 5) -> float:
    """Best mean over several rounds: other processes on a small machine only ever add time."""
    for _ in range(max(3, repeats // 10)):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--max-gather-elements", type=int, default=ChunkBudget().max_gather_elements)
    parser.add_argument("--max-blocks", type=int, default=ChunkBudget().max_blocks)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    for dtype in (torch.float32, torch.bfloat16):
        for batch in args.batches:
            budget = ChunkBudget(max_blocks=args.max_blocks, max_gather_elements=args.max_gather_elements)
            case = decode_case(
                batch, args.context, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype, budget
            )
            first, fresh, reused = measure(*case, repeats=args.repeats)
            print(
                f"{str(dtype):15s} decode batch {batch:3d} context {args.context}: "
                f"{reused * 1e6:8.1f} us/call (plan reused), {fresh * 1e6:8.1f} us/call (plan built), "
                f"first call {first * 1e3:.2f} ms"
            )


def measure(backend, q, k, v, cache, md, repeats: int) -> tuple[float, float, float]:
    """Seconds per call: the very first call, with the plan rebuilt each call, with it reused."""

    def call() -> None:
        backend.forward(q, k, v, cache, md)

    def call_fresh() -> None:
        md.extras.clear()
        backend.forward(q, k, v, cache, md)

    first = time_calls(call, 1, rounds=1)
    # a fresh plan each call = the first layer of a step; the cached plan = every other layer
    return first, time_calls(call_fresh, repeats), time_calls(call, repeats)


if __name__ == "__main__":
    main()

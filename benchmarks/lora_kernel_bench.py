"""The batched LoRA kernels (:mod:`engine_plugin_sdk.gpu.triton_kernels.lora_kernels`) against the base
projection they ride on, on one CUDA GPU.

For each shape (``in -> out``) and row count it prints the base ``torch.nn.functional.linear`` time, the
``add_lora`` time (8 slots of rank 16, every slot read by some rows when there are enough rows), their ratio,
and the kernels' largest error against the torch default (``grouped_add_lora`` in float32), so that a wrong
result on the GPU shows next to the time. Times are medians of CUDA-event timings over replays of a CUDA
graph holding ``--inner`` calls (no host launch cost, as inside the engine's decode graphs); ``--eager``
times plain launches instead. The goal at decode sizes (rows <= 64): ``add_lora`` within about 20 % of a
bf16 4096 x 4096 single-row product.

    python benchmarks/lora_kernel_bench.py
    python benchmarks/lora_kernel_bench.py --sweep          # a few tile variants per row count
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable

import torch

#: (in_features, out_features): a 4096-wide model's q/o projection, its gate/up and its down projection
SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
ROWS = (1, 16, 64, 256, 2048)
SLOTS = 8
RANK = 16


def timed(fn: Callable[[], object], eager: bool, repeats: int = 20, inner: int = 20) -> float:
    """Median microseconds of one ``fn()``: ``inner`` calls per CUDA graph replay (or per eager loop)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles the kernels and warms the allocator outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = None
    if not eager:
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
        if graph is not None:
            graph.replay()
        else:
            for _ in range(inner):
                fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return sorted(times)[len(times) // 2]


def tile_variants(sweep: bool) -> dict[str, object]:
    """The default tiles, and with ``sweep`` a few alternatives around them."""
    from engine_plugin_sdk.gpu.triton_kernels.lora_launchers import H200_LORA_TILES

    variants: dict[str, object] = {"default": H200_LORA_TILES}
    if sweep:
        for block_n in (64, 256):
            variants[f"bn{block_n}"] = dataclasses.replace(H200_LORA_TILES, block_n=block_n)
        for split in (1, 4, 8, 32):
            variants[f"split{split}"] = dataclasses.replace(H200_LORA_TILES, max_split_k=split)
        variants["bk64"] = dataclasses.replace(H200_LORA_TILES, block_k=64)
        variants["warps2"] = dataclasses.replace(H200_LORA_TILES, num_warps=2)
        variants["warps8"] = dataclasses.replace(H200_LORA_TILES, num_warps=8)
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--eager", action="store_true", help="time plain launches, not CUDA graph replays")
    parser.add_argument("--sweep", action="store_true", help="also time a few tile variants")
    parser.add_argument("--inner", type=int, default=20, help="calls per timed graph replay")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")

    from engine.interfaces.lora import LoraStep, LoraWeights, group_lora_rows, grouped_add_lora
    from engine_plugin_sdk.gpu.triton_kernels.lora_launchers import add_lora, sort_lora_rows

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    variants = tile_variants(args.sweep)
    gemv_x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    gemv_w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    gemv_us = timed(lambda: torch.nn.functional.linear(gemv_x, gemv_w), args.eager, inner=args.inner)
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  slots {SLOTS} rank {RANK}  "
          f"{'eager' if args.eager else 'CUDA graph'}  bf16 4096x4096 GEMV (1 row): {gemv_us:.2f} us, "
          f"target add_lora <= {0.2 * gemv_us:.2f} us at rows <= 64")  # fmt: skip
    columns = ("in->out", 13), ("rows", 5), ("variant", 8), ("linear us", 10), ("lora us", 8), ("lora/lin", 9)
    header = " ".join(f"{name:>{width}}" for name, width in columns) + f" {'max err':>9}"
    print(header)
    print("-" * len(header))
    for in_features, out_features in SHAPES:
        weight = torch.randn(out_features, in_features, device="cuda", dtype=dtype, generator=gen) * 0.02
        a = (
            torch.randn(SLOTS, RANK, in_features, device="cuda", dtype=dtype, generator=gen)
            * in_features**-0.5
        )
        b = torch.randn(SLOTS, out_features, RANK, device="cuda", dtype=dtype, generator=gen) * RANK**-0.5
        scales = torch.rand(SLOTS, device="cuda", generator=gen) + 0.5
        weights = LoraWeights(a, b, scales)
        for rows in args.rows:
            x = torch.randn(rows, in_features, device="cuda", dtype=dtype, generator=gen)
            # every slot in turn, one row in nine without an adapter
            slot_list = [-1 if t % 9 == 8 else t % SLOTS for t in range(rows)]
            # sorted once per step by the engine's plan, as here
            slots = sort_lora_rows(torch.tensor(slot_list, dtype=torch.int32, device="cuda"))
            y = torch.nn.functional.linear(x, weight)
            base = functools.partial(torch.nn.functional.linear, x, weight)
            linear_us = timed(base, args.eager, inner=args.inner)
            want = y.float()
            plan = group_lora_rows(LoraStep(slots.order, tuple(slot_list), SLOTS))
            f32 = LoraWeights(a.float(), b.float(), scales)
            grouped_add_lora(want, x.float(), f32, plan)
            for name, tiles in variants.items():
                got = y.clone()
                add_lora(got, x, weights, slots, tiles)
                err = float((got.float() - want).abs().max())
                lora = functools.partial(add_lora, y.clone(), x, weights, slots, tiles)
                lora_us = timed(lora, args.eager, inner=args.inner)
                print(f"{in_features:>5}->{out_features:<6} {rows:>5} {name:>8} {linear_us:>10.2f} "
                      f"{lora_us:>8.2f} {lora_us / linear_us:>9.3f} {err:>9.2e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""Whether a weight asked of the L2 cache before a few small kernels (a decode layer's norms and attention at
batch 1) is then read faster by the product that needs it. One CUDA graph a variant over weight copies past
the L2 cache: each copy's ``[prefetch] -> SPACERS small kernels -> product``, against the same without the
prefetch; bf16 (cuBLAS) and W4A16 (the plugin's kernels at 1 row) of Llama-3-8B's shapes.

    source benchmarks/nvidia_h200_setup.sh && python benchmarks/nvidia_h200_l2_prefetch.py --json $OUT/l2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def l2_prefetch_kernel():
    """The one-off kernel this script times (defined on first use: ``triton`` is imported on the device only):
    asks the L2 cache for bytes ``[0, nbytes)`` of ``ptr``, ``LINES`` 128-byte lines a program, and ends, so the
    lines arrive while the kernels queued after it run."""
    import triton
    import triton.language as tl

    from engine_plugin_sdk.gpu.triton_kernels.l2_prefetch import prefetch_l2

    @triton.jit
    def kernel(ptr, nbytes, LINES: tl.constexpr, ASM: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * (LINES * 128) + tl.arange(0, LINES) * 128
        prefetch_l2(ptr + offs, offs < nbytes, ASM)

    return kernel


def weights_of(kind: str, n: int, k: int, copies: int, gen: Any) -> tuple[list[Any], list[Any], int]:
    """``copies`` random weights of ``kind``, the tensor of each that a prefetch asks for, and its bytes."""
    import torch

    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import pack_grouped_codes
    from engine_plugin_sdk.grouped_codes import GroupedCodes

    if kind == "bf16":
        weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(copies)]
        return weights, weights, n * k * 2
    weights = []
    for _ in range(copies):
        codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.uint8)
        scales = torch.rand(n, k // 128, device="cuda", generator=gen) * 0.02 + 0.001
        weights.append(pack_grouped_codes(GroupedCodes(codes, scales, None, 8, 4, 128), 128, torch.device("cuda")))
    return weights, [w.codes for w in weights], n * k // 2 + n * (k // 128) * 2


def main() -> None:
    import torch
    import triton
    from nvidia_h200_word_gemv import timed

    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import grouped_int_linear
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import H200_GROUPED_INT_TILES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spacers", type=int, nargs="+", default=[0, 2, 4], help="small kernels between")
    parser.add_argument("--prefetch-mb", type=float, nargs="+", default=[8, 32], help="MB asked of L2 (at most)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    small = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    results: dict[str, Any] = {}
    lines = 64
    prefetch_kernel = l2_prefetch_kernel()
    for name in args.shapes:
        n, k = SHAPES[name]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for kind in ("bf16", "w4a16"):
            copies = max(2, min(16, (512 << 20) // (n * k * (2 if kind == "bf16" else 1) // 2)))
            weights, storage, nbytes = weights_of(kind, n, k, copies, gen)
            for spacers in args.spacers:
                for cap_mb in [0.0, *args.prefetch_mb]:
                    asked = min(int(cap_mb * (1 << 20)), storage[0].numel() * storage[0].element_size())

                    def body(i: int, asked: int = asked, spacers: int = spacers, kind: str = kind,
                             weights: list[Any] = weights, storage: list[Any] = storage, x: Any = x) -> None:  # fmt: skip
                        if asked:
                            flat = storage[i].view(-1).view(torch.uint8)
                            prefetch_kernel[(triton.cdiv(asked, lines * 128),)](flat, asked, LINES=lines, ASM=True,
                                                                                 num_warps=2)  # fmt: skip
                        for _ in range(spacers):
                            small.mul_(1.0)
                        if kind == "bf16":
                            torch.nn.functional.linear(x, weights[i])
                        else:
                            grouped_int_linear(x, weights[i], None, H200_GROUPED_INT_TILES)

                    us = timed(body, list(range(copies))) * 1e6
                    label = f"{name} {kind} spacers={spacers} prefetch={cap_mb:g}MB"
                    results[label] = {"us": us, "weight_MB": nbytes / 2**20}
                    print(f"{label:50s} {us:8.2f} us  (weight {nbytes / 2**20:.1f} MB)", flush=True)
            del weights, storage
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()

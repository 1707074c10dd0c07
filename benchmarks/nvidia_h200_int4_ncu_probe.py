"""A short program for Nsight Compute: Llama-3-8B's 4-bit products (groups of 128, one zero point) by the
kernels and variants named on the command line, each launched once, in the order printed first (so the
report's launches 0, 1, ... are those labels). Profile it on the H200 (hardware counters are read there with
the clocks left alone), for example the stall reasons of each launch:

    source benchmarks/nvidia_h200_setup.sh
    ncu --clock-control none -k regex:"grouped_int4" --metrics \\
        regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,gpu__time_duration.sum \\
        python benchmarks/nvidia_h200_int4_ncu_probe.py --shapes gate_up down --variants word frag2 frag2a

Variants: ``word`` the word GEMV (one row), ``dot`` the integer-dot GEMV (``dotA`` its operands a step ahead
for every form of codes, ``dot8w2`` 8 rows a program, 2 warps), ``fragD`` the fragment kernel reading D iterations ahead, ``fragDa``
the same with its scales read with its words (``GroupedIntTiles.fragment_ahead``), ``fragDpP`` with L2 prefetches
``P`` iterations past its read-ahead (``GroupedIntTiles.fragment_prefetch``); ``--rows`` 1-8.
"""

from __future__ import annotations

import argparse
import dataclasses

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def tiles_of(variant: str, h200: object) -> object:
    """The ``GroupedIntTiles`` a variant label names."""
    if variant == "word":
        return dataclasses.replace(h200, fragment_rows=0, mma_rows=0, dot_gemv_rows=0)
    if variant.startswith("dot"):
        # dot, dotA (words a step ahead), dot<rows>w<warps>[A]: the integer-dot GEMV
        spec = variant[3:].rstrip("A")
        rows, warps = (int(v) for v in spec.split("w")) if spec else (h200.dot_gemv_rows, h200.dot_gemv_warps)
        ahead = variant.endswith("A")
        return dataclasses.replace(h200, dot_gemv_rows=rows, dot_gemv_warps=warps, dot_gemv_ahead=ahead,
                                   dot_gemv_ahead_all=ahead)
    if not variant.startswith("frag"):
        raise SystemExit(f"unknown variant {variant!r}")
    depth = int(variant[4])
    prefetch = int(variant.split("p", 1)[1]) if "p" in variant[5:] else 0
    return dataclasses.replace(
        h200, fragment_rows=8, fragment_min_rows=1, fragment_depth=depth, fragment_ahead=variant.endswith("a"),
        fragment_prefetch=prefetch,
    )


def main() -> None:
    import torch

    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import grouped_int_linear
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import pack_grouped_codes
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import H200_GROUPED_INT_TILES
    from engine_plugin_sdk.grouped_codes import GroupedCodes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["gate_up"], choices=list(SHAPES))
    parser.add_argument("--variants", nargs="+", default=["word", "frag2"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    launches = []
    work = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.uint8)
        scales = (torch.rand(n, k // 128, device="cuda", generator=gen) * 0.02 + 0.001).half().float()
        weight = pack_grouped_codes(GroupedCodes(codes, scales, None, 8, 4, 128), 128, torch.device("cuda"))
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            for variant in args.variants:
                if (variant == "word" or variant.startswith("dot")) and rows > 1:
                    continue
                launches.append(f"{shape} {rows} rows {variant}")
                work.append((x, weight, tiles_of(variant, H200_GROUPED_INT_TILES)))
    for index, label in enumerate(launches):
        print(f"launch {index}: {label}", flush=True)
    for x, weight, tiles in work:
        grouped_int_linear(x, weight, None, tiles)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

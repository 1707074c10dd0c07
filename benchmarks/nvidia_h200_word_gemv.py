"""The 4-bit products of a few rows on the H200. One row: the byte-reading GEMV against the word-reading one
(:mod:`engine_plugin_sdk.gpu.triton_kernels.grouped_int4_gemv_kernels`) over its tiles; 2-16 rows
(``--rows``): the grouped GEMM against the tensor-core kernel
(:mod:`engine_plugin_sdk.gpu.triton_kernels.grouped_int4_mma_kernels`); up to 8 rows, the fragment kernel
(:mod:`engine_plugin_sdk.gpu.triton_kernels.grouped_int4_fragment_kernels`) with ``--fragment-warps`` and
``--fragment-depth``; at one row the integer-dot GEMV
(:mod:`engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_gemv_kernels`) with ``--dot-rows`` and
``--dot-warps``. Llama-3-8B shapes, random codes in groups of 128 (``--group 32``: GGUF Q4_K's blocks), one
zero point (GPTQ's) and zero scales (asymmetric), bf16 activations; error against float64 and time inside
CUDA graphs over weight copies larger than the L2 cache.

    source benchmarks/nvidia_h200_setup.sh && python benchmarks/nvidia_h200_word_gemv.py [--rows 1 4 16] \
        --json $OUT/word_gemv.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # fmt: skip
#: (row bytes, warps) of the word GEMV, four rows a program
WORD_TILES = [(512, 2), (1024, 2), (2048, 2), (1024, 4), (2048, 4), (4096, 4)]


def timed(fn: Any, items: list[Any], repeats: int = 10) -> float:
    """Median seconds of one ``fn(item)``, the items taken in turn inside one CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for item in items:
            fn(item)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for item in items:
            fn(item)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(items))
    return sorted(times)[len(times) // 2]


def variants_for(
    rows: int, tiles_class: Any, h200: Any, fragment_warps: list[int], fragment_depth: list[int], all_words: bool,
    loop_stages: tuple[int, ...] = (1,), fragment_ahead: tuple[bool, ...] = (False,),
    fragment_prefetch: tuple[int, ...] = (0,), dot: tuple[tuple[int, int], ...] = (),
    dot_ahead: tuple[bool, ...] = (False,), dot_row_groups: tuple[int, ...] = (1,),
) -> dict[str, Any]:
    """The kernels compared at ``rows`` activation rows, by label: the H200's defaults, the kernels it
    would take without the fragment kernel (the GEMVs with each of ``loop_stages``), and the fragment kernel
    with each of ``fragment_warps``, ``fragment_depth`` (iterations a warp reads its words ahead) and
    ``fragment_ahead`` (its scales with them, the activations an iteration ahead) and ``fragment_prefetch`` (L2
    prefetches that many iterations past the read-ahead); at one row the integer-dot GEMV with each ``(rows,
    warps)`` of ``dot``, each with each of ``dot_ahead`` (its words a step ahead) and of ``dot_row_groups`` (groups
    of rows a program of a single-step product takes one after another)."""
    variants = {"default": h200}
    if rows > 1:
        variants |= {"grouped GEMM": tiles_class(), "tensor cores": tiles_class(mma_rows=16)}
    else:
        for stages in loop_stages:
            tag = f", loop stages {stages}" if stages > 1 else ""
            # the byte GEMV: the word GEMV's minimum block put out of reach
            variants[f"bytes 1024 B, 4 warps{tag}"] = tiles_class(
                gemv=(4, 1024, 4, 2), gemv4_min_block=1 << 30, gemv_loop_stages=stages
            )
            for row_bytes, warps in WORD_TILES if all_words else [tiles_class().gemv4[1:3]]:
                variants[f"words {row_bytes} B, {warps} warps{tag}"] = tiles_class(
                    gemv4=(4, row_bytes, warps, 2), gemv_loop_stages=stages
                )
        for (dot_rows, dot_warps), ahead, groups in ((d, a, g) for d in dot for a in dot_ahead for g in dot_row_groups):
            label = f"dot {dot_rows} rows, {dot_warps} warps" + (", ahead" if ahead else "")
            variants[label + (f", {groups} groups" if groups > 1 else "")] = tiles_class(
                dot_gemv_rows=dot_rows, dot_gemv_warps=dot_warps, dot_gemv_ahead=ahead, dot_gemv_ahead_all=ahead,
                dot_gemv_row_groups=groups,
            )
    if rows <= 8:
        for warps in fragment_warps:
            for depth in fragment_depth:
                for ahead in fragment_ahead:
                    for prefetch in fragment_prefetch:
                        label = f"fragments, {warps} warps" + (f", {depth} ahead" if depth > 1 else "")
                        label += (", scales ahead" if ahead else "") + (f", L2 {prefetch}" if prefetch else "")
                        variants[label] = tiles_class(
                            mma_rows=16, fragment_rows=8, fragment_warps=warps, fragment_narrow_warps=warps,
                            fragment_depth=depth, fragment_ahead=ahead, fragment_prefetch=prefetch,
                        )
    return variants


def main() -> None:
    import torch

    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import grouped_int_linear
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import pack_grouped_codes
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import H200_GROUPED_INT_TILES, GroupedIntTiles
    from engine_plugin_sdk.grouped_codes import GroupedCodes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="activation rows (1-16)")
    parser.add_argument("--fragment-warps", type=int, nargs="*", default=[4, 8], help="fragment kernel's warps")
    parser.add_argument("--fragment-depth", type=int, nargs="*", default=[1],
                        help="iterations ahead the fragment kernel reads its words (GroupedIntTiles.fragment_depth)")
    parser.add_argument("--fragment-ahead", type=int, nargs="*", default=[0], choices=[0, 1],
                        help="the fragment kernel reads its scales with its words, its activations an iteration "
                        "ahead (GroupedIntTiles.fragment_ahead; 0 1 for both)")
    parser.add_argument("--fragment-prefetch", type=int, nargs="*", default=[0],
                        help="iterations past its read-ahead the fragment kernel asks the L2 cache for its words "
                        "(GroupedIntTiles.fragment_prefetch; 0 for none)")
    parser.add_argument("--all-word-tiles", action="store_true", help="every word-GEMV tile at one row")
    parser.add_argument("--gemv-loop-stages", type=int, nargs="+", default=[1],
                        help="the GEMVs' loop pipelining at one row (GroupedIntTiles.gemv_loop_stages)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dot-rows", type=int, nargs="*", default=[], help="integer-dot GEMV rows a program")
    parser.add_argument("--dot-warps", type=int, nargs="*", default=[4], help="integer-dot GEMV warps")
    parser.add_argument("--dot-ahead", type=int, nargs="*", default=[0], choices=[0, 1],
                        help="the integer-dot GEMV reads a step's words ahead (GroupedIntTiles.dot_gemv_ahead)")
    parser.add_argument("--dot-row-groups", type=int, nargs="*", default=[1],
                        help="groups of rows a program of a single-step product takes (GroupedIntTiles.dot_gemv_row_groups)")
    parser.add_argument("--group", type=int, default=128, choices=[32, 128], help="columns a group (and block)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict[str, Any] = {}
    for name, (n, k) in ((name, SHAPES[name]) for name in args.shapes):
        group = args.group
        nbytes = n * k // 2 + n * (k // group) * 2
        copies = max(1, min(16, (384 << 20) // nbytes))
        xs = {m: torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16) for m in args.rows}
        row: dict[str, Any] = {}
        for zero_scales in (False, True):
            weights, dense = [], None
            for _ in range(copies):
                codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.uint8)
                scales = (torch.rand(n, k // group, device="cuda", generator=gen) * 0.02 + 0.001).half().float()
                zs = torch.rand(n, k // group, device="cuda", generator=gen) * 0.1 if zero_scales else None
                if dense is None:
                    wide = scales.double().repeat_interleave(group, 1)
                    dense = codes.double() * wide - zs.double().repeat_interleave(group, 1) if zs is not None \
                        else (codes.double() - 8) * wide  # fmt: skip
                unpacked = GroupedCodes(codes, scales, zs, 0 if zero_scales else 8, 4, group)
                weights.append(pack_grouped_codes(unpacked, group, torch.device("cuda")))
            for m, x in xs.items():
                tag = f"{m} rows, " + ("zero scales" if zero_scales else "one zero point")
                ref = x.double() @ dense.T
                for label, tiles in variants_for(
                    m, GroupedIntTiles, H200_GROUPED_INT_TILES, args.fragment_warps, args.fragment_depth,
                    args.all_word_tiles, tuple(args.gemv_loop_stages), tuple(bool(a) for a in args.fragment_ahead),
                    tuple(args.fragment_prefetch), tuple((r, w) for r in args.dot_rows for w in args.dot_warps),
                    tuple(bool(a) for a in args.dot_ahead), tuple(args.dot_row_groups),
                ).items():
                    got = grouped_int_linear(x, weights[0], None, tiles).double()
                    err = float((got - ref).norm() / ref.norm())
                    sec = timed(lambda w, tiles=tiles, x=x: grouped_int_linear(x, w, None, tiles), weights)
                    row[f"{tag}: {label}"] = {"us": sec * 1e6, "TBps": nbytes / sec / 1e12, "rel_err": err}
                    print(f"{name:8s} {tag:25s} {label:24s} {sec * 1e6:8.1f} us {nbytes / sec / 1e12:5.2f} TB/s "
                          f"err {err:.1e}", flush=True)  # fmt: skip
            del weights
        results[name] = row
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()

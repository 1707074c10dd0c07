"""The grouped GEMM over GGUF Q6_K's codes at a few rows (2-8 sequences decoding), a byte a code against 6 bits,
by tile (no engine; one Llama-3-8B product at a time, dummy weights).

Why: with every Q6_K weight in 6 bits (``GroupedIntTiles.six_bit_codes``) GGUF Q4_K_M batch-1 decode ran 3.9%
faster on an H100 (session 54) but 4 sequences 14% slower: at 4 rows Q6_K's products take the grouped GEMM, and
there its 6-bit form took 82 / 529 us (Q6_K down_proj / the LM head, without PDL) against 55 / 377 for a byte a
code. This sweeps the GEMM's tiles for small row counts for both forms, so that a tile where 6 bits are no slower
can be chosen (or shown not to exist).

    python benchmarks/nvidia_h200_six_bit_gemm.py --rows 4 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

#: Q6_K products of Llama-3-8B's Q4_K_M: half the layers' down_proj, and the LM head
SHAPES = {"down": (4096, 14336), "lm_head": (128256, 4096)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--kinds", nargs="+", default=["gguf_q6_k"], help="gguf_q6_k, gguf_q8_0, gguf_q5_k ...")
    parser.add_argument("--forms", type=int, nargs="+", default=[8, 6], help="8: a byte a code; 6: six_bit_codes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch
    from nvidia_h200_quantized import random_weight, timed_rotating

    from engine_plugin_nvidia.gemm import CudaGemmBackend
    from engine_plugin_sdk.gpu.triton_kernels import pdl
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import dequantize_packed
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import H200_GROUPED_INT_TILES as BASE

    pdl.configure(torch.cuda.get_device_capability()[0] >= 9)
    gen = torch.Generator(device="cuda").manual_seed(0)
    gemm = CudaGemmBackend("cuda")
    results: dict[str, Any] = {}
    grid = list(itertools.product(args.block_n, args.warps, args.stages, args.block_k))
    for (shape, (n, k)), kind in itertools.product(SHAPES.items(), args.kinds):
        raw = random_weight(kind, n, k, "cuda", gen)
        # distinct copies, together past the L2 cache, so that each call reads its weight from memory (one copy of
        # down_proj's 59 MB a byte a code mostly stays in an H100's 50 MB of L2 between calls)
        copies = max(1, min(8, (256 << 20) // (n * k)))
        for six in (bits == 6 for bits in args.forms):
            gemm.grouped_int_tiles = dataclasses.replace(BASE, six_bit_codes=six)
            weights = [gemm.prepare_weight(raw, torch.bfloat16) for _ in range(copies)]
            weight = weights[0]
            reference = dequantize_packed(weight).double()
            form = f"{kind} {'6-bit' if six else '8-bit'}"
            for m in args.rows:
                xs = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                ref = xs.double() @ reference.T
                timings = []
                for block_n, warps, stages, block_k in grid:
                    first = (16, 16, block_n, warps, stages)
                    gemm.grouped_int_tiles = dataclasses.replace(
                        BASE, six_bit_codes=six, gemm=(first, *BASE.gemm[1:]), gemm_block_k=block_k
                    )
                    got = gemm.linear(xs, weight).double()
                    err = float((got - ref).norm() / ref.norm())
                    sec = timed_rotating(lambda w, xs=xs: gemm.linear(xs, w), weights)
                    label = f"{shape} {form} M={m} n{block_n} w{warps} s{stages} k{block_k}"
                    results[label] = {"us": sec * 1e6, "TBps": weight.nbytes / sec / 1e12, "rel_err": err}
                    timings.append((sec * 1e6, label, err))
                default = BASE.gemm[0][2:], BASE.gemm_block_k
                for us, label, err in sorted(timings)[:4]:
                    print(f"{label:44s} {us:8.1f} us  rel err {err:.1e}", flush=True)
                at_default = f"n{default[0][0]} w{default[0][1]} s{default[0][2]} k{default[1]}"
                mark = [t for t in timings if t[1].endswith(at_default)]
                if mark:
                    print(f"{mark[0][1]:44s} {mark[0][0]:8.1f} us  (the defaults)", flush=True)
            del weight, weights, reference
        del raw
        torch.cuda.empty_cache()
    gemm.grouped_int_tiles = None
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()

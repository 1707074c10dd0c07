"""Batch-1 decode with and without the GEMVs' L2 requests before their PDL wait (``l2_ahead`` in the NVIDIA plugin's
GEMV tiles, ``MoeTiles.down_l2_rest``), variants alternated in one process with the decode graphs recaptured for
each: Llama-3-8B in bf16 (decode steps and end to end) and a Qwen3-30B-A3B-shaped MoE.

Why: the kernels before a GEMV (norms, decode attention and its merge, the routing) are bound by latency, not
bytes, so the memory idles through them although the next weight is known; a GEMV's programs that start early
under PDL hold ``prefetch`` tiles in registers and can ask L2 for the rest of their rows, and for the rows of
programs of later waves, without registers.

    python benchmarks/nvidia_h200_l2_ahead.py --tokenizer .nvcarry/llama3-8b-dummy --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from typing import Any

#: variant -> (narrow GEMVs' l2_ahead (o_proj, down), wide ones' (qkv, the router), the gated GEMV's, MoE down rest)
VARIANTS = {
    "off": (0, 0, 0, False),
    "narrow 1": (1, 0, 0, False),
    "narrow 1, wide 2, gated 1, moe down": (1, 2, 1, True),
    "narrow 2, wide 2, gated 1, moe down": (2, 2, 1, True),
}


def apply(llm: Any, variant: tuple[int, int, int, bool]) -> None:
    from engine_plugin_nvidia import gemm as nv_gemm
    from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import MoeTiles

    narrow, wide, gated, moe_down = variant
    nv_gemm.GEMV_TILE["l2_ahead"] = narrow
    if nv_gemm.GEMV_WIDE_TILE is not None:
        nv_gemm.GEMV_WIDE_TILE["l2_ahead"] = wide
    nv_gemm.GATED_GEMV_TILE["l2_ahead"] = gated
    gemm = llm.llm_engine.model.gemm
    gemm.moe_tiles = dataclasses.replace(gemm.moe_tiles or MoeTiles(), down_l2_rest=moe_down)
    llm.llm_engine.runner.decode_graphs.capture()


def run(llm: Any, roofline: float, rounds: int, label: str) -> dict[str, Any]:
    from nvidia_h200 import decode_rates

    out: dict[str, Any] = {}
    for r in range(rounds):
        for name, variant in VARIANTS.items():
            apply(llm, variant)
            steps, end_to_end = decode_rates(llm)
            out.setdefault(name, []).append({"decode_tok_s": steps, "end_to_end_tok_s": end_to_end})
            print(f"{label} round {r + 1} {name:38s} {steps:7.1f} tok/s ({steps / roofline:.3f}), end to end "
                  f"{end_to_end:7.1f} ({end_to_end / roofline:.3f})", flush=True)  # fmt: skip
    apply(llm, VARIANTS["off"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="the dummy Llama-3-8B folder (config and tokenizer)")
    parser.add_argument("--models", nargs="+", default=["llama", "moe"], choices=["llama", "moe"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    from nvidia_h200 import copy_bandwidth, make_llm, release, weight_bytes
    from nvidia_h200_moe import make_moe_llm, moe_model_folder, step_bytes

    bandwidth = copy_bandwidth()
    results: dict[str, Any] = {"copy_bandwidth_TBps": bandwidth / 1e12}
    for model in args.models:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            if model == "llama":
                llm = make_llm(args.tokenizer, max_num_seqs=8, kv_cache_memory_bytes=8 << 30)
                read = weight_bytes(llm)[1]
            else:
                folder = moe_model_folder(args.tokenizer, os.path.join(tmp, "qwen3-30b-a3b"))
                llm = make_moe_llm(folder, max_num_seqs=8, kv_cache_memory_bytes=8 << 30, max_model_len=4096)
                read = step_bytes(llm)[1]
            print(f"{model}: loaded in {time.perf_counter() - t0:.0f} s, reads {read / 1e9:.2f} GB a step", flush=True)
            roofline = bandwidth / read
            results[model] = {"GB_read_per_step": read / 1e9, "roofline_tok_s": roofline,
                              "variants": run(llm, roofline, args.rounds, model)}  # fmt: skip
            llm.shutdown()
            del llm
            release()
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

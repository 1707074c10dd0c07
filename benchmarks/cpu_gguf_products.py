"""One product a GGUF type at a time on the CPU plugin: the C kernels' tiled form (as the GEMM backend prepares
it) against the same weight dequantized to bf16 (as it was before the type was kept quantized), batch 1 and 4.

    python benchmarks/cpu_gguf_products.py [--shape 2048 8192] [--types Q4_K Q5_K Q6_K Q8_0]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    import torch

    from engine_plugin_cpu.gemm import CpuGemmBackend
    from engine_plugin_cpu.native_build import load_native, native_prerequisites
    from engine_plugin_cpu.native_kernels import NativeKernels
    from engine_plugin_sdk.quant import make_quantized_weight

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[2048, 8192], metavar=("OUT", "IN"))
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if native_prerequisites():
        raise SystemExit(f"no C kernels here: {native_prerequisites()}")
    native = NativeKernels(load_native().lib)
    tiled_gemm = CpuGemmBackend(native=native)
    dense_gemm = CpuGemmBackend()
    out, width = args.shape
    print(f"{out} x {width}, {torch.get_num_threads()} threads")
    for type_name in args.types:
        weight = make_quantized_weight("gguf_" + type_name.lower(), out, width, seed=1)
        tiled = tiled_gemm.prepare_weight(weight, torch.bfloat16)
        dense = dense_gemm.prepare_weight(weight.dequantize(), torch.bfloat16)
        for rows in args.rows:
            x = torch.randn(rows, width).to(torch.bfloat16)
            times = {}
            for label, gemm, w in (("tiled", tiled_gemm, tiled), ("bf16", dense_gemm, dense)):
                for _ in range(5):
                    gemm.linear(x, w)
                start = time.perf_counter()
                for _ in range(args.repeats):
                    gemm.linear(x, w)
                times[label] = (time.perf_counter() - start) / args.repeats
            print(f"{type_name:5s} rows {rows}: tiled {times['tiled'] * 1e6:8.0f} us, bf16 {times['bf16'] * 1e6:8.0f} us"
                  f"  ({times['bf16'] / times['tiled']:.2f}x)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

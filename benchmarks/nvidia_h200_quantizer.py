"""The per-row FP8 activation quantizer on an H200: the plugin's kernel against a copy with an IEEE
quotient per value or a product by the reciprocal, at several warp counts (diagnostic; see BENCHMARKS.md).
"mismatch" is the fraction of FP8 values that differ from the plugin kernel's; "decode" adds the
decode-attention table of nvidia_h200_fp8.py at two batch shapes.

Usage: python benchmarks/nvidia_h200_quantizer.py quant [decode]
"""
from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from nvidia_h200_fp8 import _median_seconds  # noqa: E402


@triton.jit
def qk(out_ptr, scale_ptr, x_ptr, stride_x, stride_out, K: tl.constexpr, BLOCK: tl.constexpr,
       FP8_MAX: tl.constexpr, RCP: tl.constexpr, ROWS: tl.constexpr):
    for r in range(ROWS):
        row = (tl.program_id(0) * ROWS + r).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 0), FP8_MAX), 1.0e-12)
        if RCP:
            q = x * tl.div_rn(1.0, scale)
        else:
            q = tl.div_rn(x, scale)
        q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + row * stride_out + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)


def quant_table():
    from engine_plugin_sdk.gpu.triton_kernels.launchers import quantize_rows_fp8
    print(f"{'rows x K':14s} {'variant':24s} {'us':>8s} {'TB/s':>6s} {'mismatch':>9s}")
    for m, k in [(16384, 4096), (16384, 14336), (1008, 4096), (1008, 14336)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref, ref_s = quantize_rows_fp8(x)
        nbytes = m * k * 3
        t = _median_seconds(functools.partial(quantize_rows_fp8, x))
        print(f"{m}x{k:<8d} {'current':24s} {t*1e6:8.1f} {nbytes/t/1e12:6.2f}")
        block = triton.next_power_of_2(k)
        for rcp in (False, True):
            for warps in (4, 8, 16, 32):
                for rows in (1, 2):
                    if m % rows:
                        continue
                    out = torch.empty((m, k), dtype=torch.float8_e4m3fn, device="cuda")
                    sc = torch.empty((m, 1), dtype=torch.float32, device="cuda")
                    fn = functools.partial(
                        qk[(m // rows,)], out, sc, x, x.stride(0), out.stride(0), K=k, BLOCK=block, FP8_MAX=448.0,
                        RCP=rcp, ROWS=rows, num_warps=warps,
                    )  # fmt: skip
                    try:
                        t = _median_seconds(fn)
                    except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported
                        print(f"{m}x{k} rcp={rcp} w{warps} r{rows}: FAILED {type(e).__name__}")
                        continue
                    mism = (out.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()
                    print(f"{m}x{k:<8d} {'rcp' if rcp else 'div'}{'':1s} w{warps:<3d} rows{rows:<10d} {t*1e6:8.1f} "
                          f"{nbytes/t/1e12:6.2f} {mism:9.2e}")


if __name__ == "__main__":
    from nvidia_h200_fp8 import decode_attention_table

    if "quant" in sys.argv:
        quant_table()
    if "decode" in sys.argv:
        decode_attention_table(1024, 640)
        decode_attention_table(1008, 560)

"""An H200 stand-in on an H100: a benchmark run on part of the GPU's multiprocessors (a CUDA green context).

Why: the issues' figures are the H200's, and the device tool lends H100s. Both chips have 132 SMs with the same
issue rates and latencies, but the H200 moves 4.26 TB/s where an H100 moves 3.0: per SM, each second, an H200
must pull 1.4x the bytes with the same instructions. An H100 held to 132 / 1.4 ~ 94 SMs pulls its 3.0 TB/s
through that many, so its kernels meet the H200's limits per SM: instructions a byte (the packed GEMVs at one
row) and bytes in flight a multiprocessor. What does not carry over: a whole step takes 1.4x the H200's time at
the same bandwidth use, so fixed costs (launch latencies, small kernels) weigh less here than there; the engine is
told the smaller SM count, so its grids match the part it runs on, not the H200's.

Subcommands (repository root, on the device machine after ``source benchmarks/nvidia_h200_setup.sh``):

- ``probe``: whether green contexts work here, how many SMs one of ``--sms`` got (read back from ``%smid``), and
  the copy bandwidth and a bf16 matrix product's rate on the whole GPU and on the part;
- ``run SCRIPT ARGS...``: runs a benchmark script in this process on ``--sms`` SMs, the NVIDIA plugin's tuning
  told that count (``num_compute_units``).

    python benchmarks/nvidia_sm_partition.py --sms 94 probe
    python benchmarks/nvidia_sm_partition.py --sms 94 run benchmarks/nvidia_h200_quantized.py bench --decode bf16 w4a16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import runpy
import sys
from typing import Any

import torch


def enter_partition(num_sms: int) -> Any:
    """Make a green context of ``num_sms`` SMs this thread's current context (before any stream is made)."""
    torch.cuda.init()
    torch.cuda.current_device()
    green = torch.cuda.GreenContext.create(num_sms=num_sms, device_id=0)
    green.set_context()
    return green


def sms_in_use(programs: int = 1 << 16) -> int:
    """Distinct ``%smid`` values over a large grid launched on the current stream."""
    import triton
    import triton.language as tl

    @triton.jit
    def smid_kernel(out_ptr):
        pid = tl.program_id(0)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + pid, sm)

    out = torch.empty(programs, dtype=torch.int32, device="cuda")
    smid_kernel[(programs,)](out)
    torch.cuda.synchronize()
    return int(torch.unique(out).numel())


def copy_tbps(nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read and written a second (TB/s)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timed_s(lambda: dst.copy_(src), repeats) / 1e12


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / timed_s(lambda: a @ b, repeats) / 1e12


def timed_s(fn: Any, repeats: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def measure() -> dict[str, float]:
    return {"sms": sms_in_use(), "copy_TBps": copy_tbps(), "matmul_TFLOPs": matmul_tflops()}


def keep_partition() -> None:
    """``torch.cuda.set_device`` makes the device's primary context current (the whole GPU): the engine calls it
    at start-up, so on the partition's device it does nothing here."""
    whole = torch.cuda.set_device

    def same_device(device: Any) -> None:
        if torch.cuda._get_device_index(device) != 0:
            whole(device)

    torch.cuda.set_device = same_device  # type: ignore[assignment]


def tell_engine(num_sms: int) -> None:
    """The NVIDIA plugin's tuning reports ``num_sms`` compute units (grids sized for the part, not the GPU)."""
    import engine_plugin_nvidia.tuning as nvidia_tuning

    whole = nvidia_tuning.tuning_for_device

    def part(interpret: bool) -> Any:
        tuning = whole(interpret)
        return tuning if interpret else dataclasses.replace(tuning, num_compute_units=num_sms)

    nvidia_tuning.tuning_for_device = part  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sms", type=int, default=94, help="SMs asked of the green context")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("probe")
    run = sub.add_parser("run")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.cmd == "probe":
        whole = measure()
        print(f"whole GPU: {whole}", flush=True)
        green = enter_partition(args.sms)  # the context lives as long as this object
        part = measure()
        print(f"green context of {args.sms} SMs: {part}", flush=True)
        print(json.dumps({"whole": whole, "part": part, "asked_sms": args.sms}))
        green.pop_context()
        return
    green = enter_partition(args.sms)  # the context lives as long as this object
    got = sms_in_use()
    print(f"green context: {got} SMs (asked {args.sms})", flush=True)
    keep_partition()
    tell_engine(got)
    sys.argv = [args.script, *args.args]
    runpy.run_path(args.script, run_name="__main__")
    print(f"green context after the run: {sms_in_use()} SMs", flush=True)
    green.pop_context()


if __name__ == "__main__":
    main()

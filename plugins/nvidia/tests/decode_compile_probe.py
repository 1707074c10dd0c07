"""Compiles the decode attention kernel for sm_90 without a GPU, at the launch parameters a large batch's decode
steps take in CUDA graphs (the step's key and value written by the kernel, the rotary fused, PDL on, no early first
tile), and prints as one JSON line the registers each case takes (``cuobjdump -res-usage`` on the cubin). Run by
``test_decode_kernel_registers.py`` in a process without ``TRITON_INTERPRET``; exits 3 (with a reason) where this
Triton has no bundled ``ptxas`` / ``cuobjdump``."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from fragment_compile_probe import require_bundled_ptxas  # run as a script: its folder is on sys.path
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine_plugin_sdk.gpu.triton_kernels import decode_attention_kernels as dak

POINTERS = {
    "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "arrivals_ptr": "*i32", "q_ptr": "*bf16",
    "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "new_k_ptr": "*bf16", "new_v_ptr": "*bf16",
    "slot_ptr": "*i64", "sinks_ptr": "*i32", "rot_index_ptr": "*i64", "rot_table_ptr": "*fp32", "q_norm_ptr": "*bf16",
    "k_norm_ptr": "*bf16",
}  # fmt: skip
FLOATS = ("scale", "soft_cap", "norm_eps")
#: Llama-3-8B's heads, one split, as a batch of hundreds of sequences runs
BASE = dict(NUM_QUERIES_PER_KV=4, GROUP_PAD=16, NUM_SPLITS=1, HEAD_DIM=128, D_PAD=128, KV_BLOCK=16, USE_WINDOW=False,
            USE_CAP=False, IS_FP32=False, WRITE_KV=True, USE_PDL=True, USE_SINKS=False, ROTARY=True, HEAD_NORM=False,
            MERGE_LAST=False, EARLY_KV=False, SKIP_IDLE=False)  # fmt: skip
#: name -> (cache element type, constants, warps, stages): the NVIDIA table's tiles
CASES = {
    "fp8 two heads": ("fp8e4nv", dict(BASE, BLOCK_N=64, DOT_F16=True, KV_HEADS=2, PRESCALED=True), 4, 2),
    "bf16 one head": ("bf16", dict(BASE, BLOCK_N=64, DOT_F16=False, KV_HEADS=1, PRESCALED=False), 4, 2),
}


def registers(cache: str, constants: dict, warps: int, stages: int) -> int:
    fn = dak.paged_decode_kernel
    parameters = inspect.signature(fn.fn).parameters
    params = list(parameters)
    # a constexpr the case does not name takes its default (a new kernel option off), never a runtime argument
    defaults = {name: p.default for name, p in parameters.items()
                if "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty}  # fmt: skip
    constants = {**defaults, **constants}
    pointers = {**POINTERS, "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}"}
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "fp32" if name in FLOATS else "i32")
        for name in params
    }
    index = {name: i for i, name in enumerate(params)}
    aligned = [name for name in params if name.startswith("stride") or name in pointers]
    attrs = {(index[name],): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True)
    return int(re.search(r"REG:(\d+)", usage.stdout).group(1))


def main() -> None:
    require_bundled_ptxas()
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        print("this Triton has no cuobjdump to read a kernel's registers with")
        sys.exit(3)
    print(json.dumps({name: registers(*case) for name, case in CASES.items()}))


if __name__ == "__main__":
    main()

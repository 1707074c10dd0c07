"""Compiles the integer-dot GEMV for sm_90 without a GPU over Q6_K's form in 6 bits and in 8 (8 rows a program,
PDL, o_proj's and down_proj's widths) and prints as one JSON line, for each: the types of the operands Triton hands
the dot products' inline asm, the widths of its global loads and its shared-memory instructions. Run
by ``test_fragment_kernel_compiles.py`` in a process without ``TRITON_INTERPRET``; exits 3 (with a reason) where
this Triton has no bundled ``ptxas``."""

from __future__ import annotations

import inspect
import json
import re

import triton
from fragment_compile_probe import require_bundled_ptxas  # run as a script: its folder is on sys.path
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine_plugin_sdk.gpu.triton_kernels import grouped_int_dot_gemv_kernels

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*u8", "scale_ptr": "*i8", "zs_ptr": "*i8", "perm_ptr": "*i32",
            "bias_ptr": "*bf16", "out_ptr": "*bf16", "super_ptr": "*fp16", "zsuper_ptr": "*fp16",
            "plane_ptr": "*u8"}  # fmt: skip
ALIGNED = ("x_ptr", "w_ptr", "scale_ptr", "out_ptr", "stride_wn", "plane_ptr", "stride_pn")
Q6_K = {"GROUP": 16, "ZERO": 32, "HAS_ZS": False, "HAS_PERM": False, "HAS_BIAS": False, "ROWS": 8, "WARPS": 4,
        "FP16": False, "ASM": True, "USE_PDL": True, "SUB_GROUPS": 16}  # fmt: skip


def compile_case(bits: int, in_features: int) -> dict:
    fn = grouped_int_dot_gemv_kernels.grouped_int_dot_gemv_kernel
    constants = {**Q6_K, "BITS": bits, "BLOCK": 32 if bits == 6 else 16,
                 "NUM_SLOTS": in_features // (32 if bits == 6 else 16)}  # fmt: skip
    signature = {}
    for name, parameter in inspect.signature(fn.fn).parameters.items():
        if name in POINTERS:
            signature[name] = POINTERS[name]
        elif name in constants:
            signature[name] = "constexpr"
        elif parameter.default is inspect.Parameter.empty or name.startswith("stride"):
            signature[name] = "i32"
        else:
            signature[name] = "constexpr"
            constants[name] = parameter.default
    index = {name: i for i, name in enumerate(signature)}
    attrs = {(index[name],): [["tt.divisibility", 16]] for name in ALIGNED}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
    llir, ptx = kernel.asm["llir"], kernel.asm["ptx"]
    call = next(line for line in llir.splitlines() if "dp2a" in line)
    operands = re.findall(r"(i32|<2 x i16>) %", call[call.rindex('"') :])
    return {
        "bits": bits,
        "in_features": in_features,
        "operands": operands,
        "loads": sorted(set(re.findall(r"ld\.global(?:\.\w+)*?\.(v\d\.b\d+|b\d+)", ptx))),
        "shared": len(re.findall(r"\b(?:ld|st)\.shared", ptx)),
    }


def main() -> None:
    require_bundled_ptxas()
    print(json.dumps([compile_case(bits, k) for bits in (6, 8) for k in (4096, 14336)]))


if __name__ == "__main__":
    main()

"""Compiles the 4-bit fragment kernel for sm_90 and sm_80 (bf16 and fp16) without a GPU and prints, as one JSON
line, how many ``mma`` instructions its PTX holds and the layouts of the tensors its inline asm takes.
Also counts the 128-bit loads ptxas put before the loop over chunks (the read-ahead of ``DEPTH``). Run by
``test_fragment_kernel_compiles.py`` in a process without ``TRITON_INTERPRET``; exits 3 (with a reason) where
this Triton has no bundled ``ptxas``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine_plugin_sdk.gpu.triton_kernels import grouped_int4_fragment_kernels as g4f

WARPS = 8
#: (capability, fp16, zero scales, iterations a warp reads its words ahead, its scales with them, the gated
#: activation of a gate/up product or -1, iterations its words are asked of the L2 cache before that (112
#: chunks of 8 warps are 14 iterations, so 20 asks for all of them before the loop), the packed block's columns
#: (32: each lane's scales in its operands)
CASES = [
    (90, False, False, 1, False, -1, 0, 128), (90, True, True, 3, False, 1, 0, 128),
    (80, False, True, 2, False, -1, 0, 128), (90, False, True, 2, True, 0, 0, 128),
    (90, False, False, 2, False, -1, 4, 128), (90, False, True, 2, False, 0, 20, 128),
    (90, False, True, 2, False, -1, 0, 32), (90, True, False, 1, False, 0, 0, 32),
]  # fmt: skip


def compile_case(
    capability: int, fp16: bool, zero_scales: bool, depth: int, ahead: bool, gated: int, prefetch: int, block: int
) -> dict:
    act = "*fp16" if fp16 else "*bf16"
    # narrow blocks as GGUF Q4_K's: a uint8 scale a group times an fp16 a super-block of eight groups
    params = "*u8" if block < 128 else "*fp16"
    signature = {
        "x_ptr": act, "w_ptr": "*u8", "scale_ptr": params, "zs_ptr": params, "perm_ptr": "*i32",
        "bias_ptr": act, "out_ptr": act, "M": "i32", "N": "i32", "stride_xm": "i32", "stride_wn": "i32",
        "stride_sn": "i32", "stride_om": "i32", "super_ptr": "*fp16", "zsuper_ptr": "*fp16",
    }  # fmt: skip
    constants = {
        "NUM_CHUNKS": 112, "GROUP": block, "ZERO": 8, "HAS_ZS": zero_scales, "HAS_PERM": False, "HAS_BIAS": False,
        "BLOCK": block, "SUB_BITS": -2004318072 if block < 128 else 0, "WARPS": WARPS, "FP16": fp16, "ASM": True, "USE_PDL": capability >= 90, "DEPTH": depth,
        "AHEAD": ahead, "GATED": gated, "PREFETCH": prefetch, "SUB_GROUPS": 8 if block < 128 else 0,
    }  # fmt: skip
    signature.update(dict.fromkeys(constants, "constexpr"))
    aligned = [["tt.divisibility", 16]]
    attrs = {(0,): aligned, (1,): aligned, (2,): aligned, (6,): aligned, (9,): aligned, (10,): aligned}
    source = ASTSource(fn=g4f.grouped_int4_fragment_kernel, signature=signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": WARPS})
    kind = "f16" if fp16 else "bf16"
    ttgir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<\{(.*)\}>", ttgir, flags=re.M))
    asm_ops = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line]
    used = sorted({layouts[name] for line in asm_ops for name in re.findall(r"tensor<\d+x4xi32, (#blocked\d*)>", line)})
    loads, prefetches_before, prefetches_in_loop = before_and_in_loop(kernel.asm["cubin"])
    return {
        "case": [capability, fp16, zero_scales, depth, ahead, gated, prefetch, block],
        "loads_before_loop": loads,
        "prefetches_before_loop": prefetches_before,
        "prefetches_in_loop": prefetches_in_loop,
        "mma": kernel.asm["ptx"].count(f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"),
        "asm_ops": len(asm_ops),
        "layouts": used,
        "expected": f"sizePerThread = [1, 4], threadsPerWarp = [32, 1], warpsPerCTA = [{WARPS}, 1], order = [1, 0]",
    }


def before_and_in_loop(cubin: bytes) -> tuple[int, int, int]:
    """128-bit global loads ptxas issues before the kernel's loop over chunks (the words read ahead, two a
    chunk, if the read-ahead survived scheduling; the activations are read inside the loop, or with
    ``AHEAD`` the first chunk's, four loads, before it), or -1 where it unrolled the loop away; and the L2
    prefetches (``CCTL.E.PF2``) before the loop and inside it."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "kernel.cubin")
        path.write_bytes(cubin)
        sass = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    for label in re.findall(r"^\s*(\.L_x_\d+):", sass, flags=re.M):
        head, _, tail = sass.partition(f"{label}:")
        body, branch, _ = tail.partition(f"BRA `({label})")
        if branch:
            return len(re.findall(r"\bLDG\.E\.128\b", head)), head.count("CCTL.E.PF2"), body.count("CCTL.E.PF2")
    return -1, -1, -1


def require_bundled_ptxas() -> None:
    """Exit 3 with a reason (the tests' skip) where this Triton bundles no ``ptxas`` to assemble with."""
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not any((bundled / name).exists() for name in ("ptxas", "ptxas-blackwell")):
        print(f"this Triton has no ptxas to assemble for the GPU (looked in {bundled})")
        sys.exit(3)


def main() -> None:
    require_bundled_ptxas()
    print(json.dumps([compile_case(*case) for case in CASES]))


if __name__ == "__main__":
    main()

"""Compiles the 4-bit word GEMV and the byte GEMV (GGUF Q4_K's 32-column blocks) for sm_90 without a GPU, their
reduction loop plain and pipelined (``LOOP_STAGES``), and prints as one JSON line how many ``cp.async`` copies
each PTX holds. Run by ``test_fragment_kernel_compiles.py`` in a process without ``TRITON_INTERPRET``; exits 3
(with a reason) where this Triton has no bundled ``ptxas``."""

from __future__ import annotations

import inspect
import json

import triton
from fragment_compile_probe import require_bundled_ptxas  # run as a script: its folder is on sys.path
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine_plugin_sdk.gpu.triton_kernels import grouped_int4_gemv_kernels, grouped_int_kernels

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*u8", "scale_ptr": "*fp16", "zs_ptr": "*fp16", "perm_ptr": "*i32",
            "bias_ptr": "*bf16", "out_ptr": "*bf16",
            "super_ptr": "*fp16", "zsuper_ptr": "*fp16"}  # fmt: skip
#: down_proj's width (14,336 columns): several iterations past the first tile
WORD = {"NUM_BLOCKS": 112, "GROUP": 128, "ZERO": 8, "HAS_ZS": False, "HAS_PERM": False, "HAS_BIAS": False,
        "BLOCK": 128, "ROWS": 4, "SUBS": 32, "EVEN": False, "USE_PDL": True, "HIGH": True, "GATED": -1}  # fmt: skip
BYTE = {"NUM_BLOCKS": 448, "GROUP": 32, "BITS": 4, "ZERO": 0, "HAS_ZS": True, "HAS_PERM": False, "HAS_BIAS": False,
        "BLOCK": 32, "ROWS": 4, "SUBS": 64, "EVEN": True, "USE_PDL": True, "HIGH": True, "GATED": -1}  # fmt: skip


def async_copies(fn: object, constants: dict, stages: int) -> int:
    params = inspect.signature(fn.fn).parameters  # type: ignore[attr-defined]
    constants = {**constants, "LOOP_STAGES": stages}
    signature = {name: POINTERS.get(name, "constexpr" if name in constants else "i32") for name in params}
    index = {name: i for i, name in enumerate(params)}
    attrs = {(index[name],): [["tt.divisibility", 16]] for name in ("x_ptr", "w_ptr", "scale_ptr", "stride_wn")}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return kernel.asm["ptx"].count("cp.async.cg") + kernel.asm["ptx"].count("cp.async.ca")


def main() -> None:
    require_bundled_ptxas()
    word = grouped_int4_gemv_kernels.grouped_int4_gemv_kernel
    # the gate/up product with SwiGLU in its epilogue compiles too
    byte = grouped_int_kernels.grouped_int_gemv_kernel
    kernels = {"word": (word, WORD), "word gated": (word, {**WORD, "GATED": 0}),
               "byte": (byte, BYTE), "byte gated": (byte, {**BYTE, "GATED": 1})}  # fmt: skip
    print(json.dumps({f"{name} {stages}": async_copies(fn, constants, stages)
                      for name, (fn, constants) in kernels.items() for stages in (1, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()

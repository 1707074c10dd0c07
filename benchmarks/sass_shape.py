"""Where a Triton kernel's loads land among its tensor-core and FMA work once ptxas has scheduled it, without a
GPU: compiles the 4-bit fragment kernel or the word GEMV for sm_90 with the bundled ``ptxas``, disassembles the
cubin with the bundled ``nvdisasm`` and prints its registers, its loop body's length and one letter an
instruction of interest, in program order:

    W  a 128-bit load whose value first feeds a LOP3 / shift (in the fragment kernel, its words of codes)
    X  a 128-bit load whose value first feeds anything else (there, a PRMT of activation pairs)
    L  a 128-bit load whose use was not found; l a 64-bit load; s a narrower one; A an async copy
       (cp.async); d a shared-memory read
    M  an HMMA; f an FFMA; | a branch

The MoE down GEMV (``moe-down``, one expert after another) issues each expert's id load and then its tile's
loads late, past the experts it loaded before its PDL wait; ``moe-down-experts`` gathers them all at once;
``moe-gate-up`` is the gate/up GEMV before it, ``moe-topk`` the routing kernel before that.

Why: a read-ahead written in Triton is only what ptxas makes of it. The fragment kernel's words read one
iteration ahead were issued after most of an iteration's ``mma`` work (``...MMMMMWWMMM|``): each warp waited a
memory latency a chunk. ``--set DEPTH=2`` shows the prologue's two chunks and one in flight through the loop.

    python benchmarks/sass_shape.py fragment --set NUM_CHUNKS=112 DEPTH=2 --warps 8
    python benchmarks/sass_shape.py word-gemv --set NUM_BLOCKS=32 SUBS=32 --warps 4 --stages 2
    python benchmarks/sass_shape.py moe-down-experts --set BLOCK_N=2 --warps 4
    python benchmarks/sass_shape.py dot-gemv --set ROWS=8 NUM_SLOTS=448 AHEAD=true --warps 4
    python benchmarks/sass_shape.py gemm --set BITS=8 --warps 4 --stages 4   # Q6_K a byte a code
    MAXNREG=80 python benchmarks/sass_shape.py dot-gemv --set ROWS=8 USE_PDL=true --warps 4   # ptxas's maxnreg
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

#: the pointer arguments' types: bf16 activations, fp16 scales, 4-bit codes as bytes
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*u8", "scale_ptr": "*fp16", "zs_ptr": "*fp16", "perm_ptr": "*i32",
            "bias_ptr": "*bf16", "out_ptr": "*bf16",
            "super_ptr": "*fp16", "zsuper_ptr": "*fp16", "plane_ptr": "*u8", "unit_ptr": "*fp32",
            "total_ptr": "*fp32"}  # fmt: skip
#: ... and of the MoE down GEMVs (bf16 experts, float32 routing weights)
MOE_POINTERS = {"act_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "scale_ptr": "*fp32", "bias_ptr": "*bf16", "ids_ptr": "*i32", "logits_ptr": "*bf16", "weights_ptr": "*fp32",
                "topw_ptr": "*fp32", "out_ptr": "*bf16",
            "super_ptr": "*fp16", "zsuper_ptr": "*fp16"}  # fmt: skip
#: the arguments the compile may assume 16-byte aligned (as the launchers' tensors are)
ALIGNED = ("x_ptr", "act_ptr", "w_ptr", "scale_ptr", "out_ptr", "stride_xm", "stride_a", "stride_we", "stride_wn",
           "plane_ptr", "stride_pn", "k_per_split", "N", "stride_sn", "stride_om", "stride_os", "super_ptr")
FRAGMENT = {"NUM_CHUNKS": 32, "GROUP": 128, "ZERO": 8, "HAS_ZS": False, "HAS_PERM": False, "HAS_BIAS": False,
            "BLOCK": 128, "FP16": False, "ASM": True, "USE_PDL": True}  # fmt: skip
WORD_GEMV = {"NUM_BLOCKS": 32, "GROUP": 128, "ZERO": 8, "HAS_ZS": False, "HAS_PERM": False, "HAS_BIAS": False,
             "BLOCK": 128, "ROWS": 4, "SUBS": 32, "EVEN": True, "USE_PDL": True, "HIGH": True}  # fmt: skip
#: GGUF Q4_K's 32-column blocks (zero scales from its mins) through the byte GEMV, down_proj's width
BYTE_GEMV = {"NUM_BLOCKS": 448, "GROUP": 32, "BITS": 4, "ZERO": 0, "HAS_ZS": True, "HAS_PERM": False,
             "HAS_BIAS": False, "BLOCK": 32, "ROWS": 4, "SUBS": 64, "EVEN": True, "USE_PDL": True, "HIGH": True}  # fmt: skip
#: the integer-dot GEMV over the same codes (o_proj's shape: 128 slots of 32 columns)
DOT_GEMV = {"NUM_SLOTS": 128, "GROUP": 128, "ZERO": 8, "HAS_ZS": False, "HAS_PERM": False, "HAS_BIAS": False,
            "BLOCK": 128, "ROWS": 4, "FP16": False, "ASM": True, "USE_PDL": True}  # fmt: skip
#: the grouped GEMM over GGUF Q6_K's codes (groups of 16, two-level scales) at 2-16 rows, the H200 tiles
GEMM = {"GROUP": 16, "BITS": 6, "ZERO": 32, "HAS_ZS": False, "HAS_PERM": False, "HAS_BIAS": False,
        "PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SUB": 32, "SUB_GROUPS": 16, "K": 4096,
        "USE_PDL": True}  # fmt: skip
#: a Qwen3-30B-A3B layer's down experts at batch 1 (H200 tiles: 4 rows, 1,024 columns, PDL prefetch of 4)
MOE_DOWN = {"K": 768, "TOP_K": 8, "K_P2": 8, "HAS_SCALE": False, "HAS_BIAS": False, "BLOCK_N": 4, "BLOCK_K": 1024,
            "USE_PDL": True, "PREFETCH": 4}  # fmt: skip
#: ... and its gate/up experts (2 gate and 2 up rows of 2,048 columns a program, SiLU)
#: ... and its routing kernel (softmax over 128 experts, top 8, renormalised: one program, one warp)
MOE_TOPK = {"NUM_GROUPS": 1, "GROUP": 128, "G_P2": 1, "S_P2": 128, "TOPK_GROUPS": 1, "TOP_K": 8, "K_P2": 8,
            "SIGMOID": False, "HAS_BIAS": False, "RENORM": True, "GROUP_MAX": False, "LOGIT_PICKS": True,
            "USE_PDL": True}  # fmt: skip
MOE_GATE_UP = {"K": 2048, "TOP_K": 8, "HAS_SCALE": False, "HAS_BIAS": False, "ACT": 0, "BLOCK_N": 2, "BLOCK_K": 1024,
               "USE_PDL": True}  # fmt: skip


def compile_kernel(kind: str, settings: dict[str, Any], warps: int, stages: int) -> Any:
    """The compiled kernel (``triton.compile``'s result) for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine_plugin_sdk.gpu.triton_kernels import (
        grouped_int4_fragment_kernels,
        grouped_int4_gemv_kernels,
        grouped_int_dot_gemv_kernels,
        grouped_int_gemm_kernels,
        grouped_int_kernels,
        moe_kernels,
        moe_routing_kernels,
    )

    pointers = POINTERS
    if kind == "fragment":
        fn, constants = grouped_int4_fragment_kernels.grouped_int4_fragment_kernel, {**FRAGMENT, "WARPS": warps}
    elif kind == "word-gemv":
        fn, constants = grouped_int4_gemv_kernels.grouped_int4_gemv_kernel, dict(WORD_GEMV)
    elif kind == "dot-gemv":
        fn = grouped_int_dot_gemv_kernels.grouped_int_dot_gemv_kernel
        constants = {**DOT_GEMV, "WARPS": warps}
    elif kind == "gemm":
        fn, constants = grouped_int_gemm_kernels.grouped_int_gemm_kernel, dict(GEMM)
    elif kind == "byte-gemv":
        fn, constants = grouped_int_kernels.grouped_int_gemv_kernel, dict(BYTE_GEMV)
    elif kind == "moe-topk":
        fn, pointers, constants = moe_routing_kernels.moe_topk_kernel, MOE_POINTERS, dict(MOE_TOPK)
    elif kind == "moe-gate-up":
        fn, pointers, constants = moe_kernels.moe_gemv_gate_up_kernel, MOE_POINTERS, dict(MOE_GATE_UP)
    else:
        fn = moe_kernels.moe_gemv_down_kernel if kind == "moe-down" else moe_kernels.moe_gemv_down_experts_kernel
        pointers, constants = MOE_POINTERS, dict(MOE_DOWN)
    parameters = inspect.signature(fn.fn).parameters
    constants = {name: value for name, value in {**constants, **settings}.items() if name in parameters}
    signature = {}
    for name, parameter in parameters.items():
        if name in pointers:
            signature[name] = pointers[name]
        elif name not in constants and (parameter.default is inspect.Parameter.empty or name.startswith("stride")):
            # a stride with a default (a 6-bit plane's) is still a runtime argument where the launcher passes it
            signature[name] = "i32"
        else:
            signature[name] = "constexpr"
            constants.setdefault(name, parameter.default)
    index = {name: i for i, name in enumerate(parameters)}
    attrs = {(index[name],): [["tt.divisibility", 16]] for name in ALIGNED if name in index}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    if os.environ.get("MAXNREG"):
        options["maxnreg"] = int(os.environ["MAXNREG"])
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def disassemble(cubin: bytes) -> tuple[list[str], str, str]:
    """The instructions (without addresses), the text with labels, and ``cuobjdump``'s resource line."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "kernel.cubin")
        path.write_bytes(cubin)
        text = subprocess.run([str(tools / "nvdisasm"), "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", str(path)], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    instructions = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(.*?);", text)]
    resources = " ".join(re.findall(r"(?:REG|SHARED|STACK|LOCAL):\d+", usage))
    return instructions, text, resources


def _opcode(instruction: str) -> str:
    words = instruction.split()
    return words[1] if words[0].startswith("@") else words[0]


def _registers(operand_text: str, width: int) -> set[str]:
    base = re.match(r"R(\d+)", operand_text)
    return {f"R{int(base.group(1)) + i}" for i in range(width)} if base else set()


def _reads(instruction: str) -> set[str]:
    sources = instruction.split(",", 1)[1] if "," in instruction else ""
    return set(re.findall(r"(?<![A-Z])R\d+", sources))


def _first_consumer(instructions: list[str], order: list[int], loaded: set[str], hops: int = 4) -> str:
    """The opcode of the first instruction of ``order`` reading ``loaded``, through register moves (a read-ahead's
    rotation)."""
    for position, i in enumerate(order):
        if not _reads(instructions[i]) & loaded:
            continue
        opcode = _opcode(instructions[i])
        if hops and (opcode.startswith("MOV") or opcode.startswith("IMAD.MOV")):
            target = instructions[i].split()[2 if instructions[i].startswith("@") else 1].rstrip(",")
            return _first_consumer(instructions, order[position + 1 :], {target}, hops - 1)
        return opcode
    return ""


def _after(index: int, count: int, loop_spans: list[tuple[int, int]]) -> list[int]:
    """The instructions that run after ``index``, each loop three times round (a value read ahead may wait
    that long to be used)."""
    order = []
    for start, end in loop_spans:
        if start <= index <= end:
            order += list(range(index + 1, end + 1)) + list(range(start, end + 1)) * 3
            index = end
    position = index + 1
    while position < count:
        span = next(((start, end) for start, end in loop_spans if start == position), None)
        if span:
            order += list(range(span[0], span[1] + 1)) * 3
            position = span[1] + 1
        else:
            order.append(position)
            position += 1
    return order


def shape(instructions: list[str], loop_spans: list[tuple[int, int]]) -> str:
    """One letter an instruction of interest (see the module's docstring)."""
    letters = []
    for index, instruction in enumerate(instructions):
        opcode = _opcode(instruction)
        if opcode.startswith("HMMA"):
            letters.append("M")
        elif opcode.startswith("FFMA"):
            letters.append("f")
        elif opcode.startswith("BRA"):
            letters.append("|")
        elif opcode.startswith("LDGSTS"):
            letters.append("A")
        elif opcode.startswith("LDS"):
            letters.append("d")
        elif opcode.startswith("LDG"):
            if ".128" not in opcode:
                letters.append("l" if ".64" in opcode else "s")
                continue
            target = instruction.split()[2 if instruction.startswith("@") else 1].rstrip(",")
            order = _after(index, len(instructions), loop_spans)
            consumer = _first_consumer(instructions, order, _registers(target, 4))
            letters.append("W" if consumer.startswith(("LOP3", "SHF")) else "L" if not consumer else "X")
    return "".join(letters)


def loops(text: str) -> list[tuple[int, int]]:
    """``(first, last)`` instruction of each loop: from a label to a later branch back to it."""
    labels: dict[str, int] = {}
    spans = []
    position = 0
    for line in text.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = position
            continue
        instruction = re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?);", line)
        if not instruction:
            continue
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", instruction.group(1))
        if target and labels.get(target.group(1), position) < position:
            spans.append((labels[target.group(1)], position))
        position += 1
    return spans


def parse_setting(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    lowered = value.lower()
    return key, (lowered == "true") if lowered in ("true", "false") else int(value)


def main() -> None:
    import triton

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=["fragment", "word-gemv", "dot-gemv", "byte-gemv", "gemm", "moe-down",
                                           "moe-down-experts", "moe-gate-up", "moe-topk"])
    parser.add_argument("--set", nargs="*", default=[], type=parse_setting, metavar="KEY=VALUE",
                        help="the kernel's constexpr arguments (integers, true / false)")
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=1)
    args = parser.parse_args()
    kernel = compile_kernel(args.kernel, dict(args.set), args.warps, args.stages)
    instructions, text, resources = disassemble(kernel.asm["cubin"])
    spans = loops(text)
    bodies = ", ".join(str(end - start + 1) for start, end in spans) or "none"
    print(f"triton {triton.__version__}, sm_90: {resources}, {len(instructions)} instructions, loop body {bodies}")
    print(shape(instructions, spans))


if __name__ == "__main__":
    main()

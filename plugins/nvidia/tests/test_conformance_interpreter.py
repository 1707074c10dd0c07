"""The conformance suite for device ``cuda`` with the kernels in Triton's interpreter (CPU CI).

It runs in a child process because the interpreter must be switched on before Triton defines kernels.
On a machine with a GPU this is the real suite (``engine conformance --device cuda``) instead.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine_conformance.runner import QUICK_OP_LEVEL, SUITE_ENV, suite_dir

#: not the quantized experts' rows (``moe.fused.quant.*``): each took 20-70 s in the interpreter (9 minutes in all);
#: their kernels' forms are test_moe_grouped_int.py's, and the rows run on a GPU and on the CPU plugin
OP_LEVEL = [p for p in QUICK_OP_LEVEL if p != "moe"] + [
    "moe.fused.float", "moe.fused.bfloat16", "moe.fused.swigluoai", "moe.topk",
]

HAS_GPU = torch.version.cuda is not None and torch.cuda.device_count() > 0



#: not the quantized schemes' K=4096 shape rows (1, 7 and 33 rows over a 7B-class width) nor the 4-bit ones' gated
#: rows: at 2-8 fp16 rows 4-bit codes take the fragment kernel, whose tensor-core operands the interpreter emulates
#: lane by lane (15-17 s a 4-bit scheme's shapes row, 4 s its gated one, half of the op-level run in all); the
#: kernels' own tests check them against float64 (test_fragment_kernels.py, test_fragment_gated.py,
#: test_dot_gemv.py, test_grouped_int_kernels.py), every scheme's plain, residual-norm and row-block rows stay here,
#: and the shape rows run on GPUs and on the CPU plugin
SKIPPED_ROWS = (
    "not (test_quantized_linear_shapes or (test_quantized_gated_linear and (gguf_q4_k or gguf_q4_0 or gguf_q4_1 "
    "or int4_grouped)))"
)


def run_suite(capabilities: list[str], skipped: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, ENGINE_NVIDIA_INTERPRET="1", TRITON_INTERPRET="1", **SUITE_ENV)
    args = [sys.executable, "-m", "pytest", str(suite_dir()), "-q", "--no-header", "-p", "no:cacheprovider", "--device", "cuda"]
    if skipped:
        args += ["-k", skipped]
    # strict: a check that cannot run in the interpreter fails here rather than skipping unseen
    args.append("--conformance-strict")
    for cap in capabilities:
        args += ["--capability", cap]
    # a guard against a hang only: on a busy 2-core CI machine the op-level run took 320 s
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=1500)


@pytest.mark.skipif(HAS_GPU, reason="on a GPU, run `engine conformance --device cuda` instead")
def test_op_level_suite_in_interpreter() -> None:
    proc = run_suite(OP_LEVEL, SKIPPED_ROWS)
    tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
    assert proc.returncode == 0, f"conformance (interpreter) failed:\n{tail}"
    assert " passed" in tail and "failed" not in tail


@pytest.mark.slow
@pytest.mark.skipif(HAS_GPU, reason="on a GPU, run `engine conformance --device cuda` instead")
def test_tiny_llama_in_interpreter_matches_transformers() -> None:
    # e2e.greedy (and e2e.greedy.n2) and e2e.step_overlap; e2e.long_prompt's 217-token prefill of a 576-wide model is too slow
    # for the interpreter and runs on the GPU suite
    proc = run_suite(["e2e.greedy", "e2e.step_overlap"])
    tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
    assert proc.returncode == 0 and " passed" in tail and "failed" not in tail, f"e2e (interpreter) failed:\n{tail}"

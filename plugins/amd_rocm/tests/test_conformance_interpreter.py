"""The conformance suite for device ``rocm``: the shared Triton kernels with the AMD (CDNA-shaped)
launch parameters, in Triton's CPU interpreter.

It runs in a child process because the interpreter must be switched on before Triton defines kernels.
On an AMD GPU this is the real suite (``engine conformance --device rocm``) instead.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

from engine_conformance.runner import SUITE_ENV, suite_dir

#: the rows whose kernels take the AMD launch parameters: in the interpreter those differ from the NVIDIA
#: plugin's only in the prefill kernel's tile for heads up to 128 (a wide-M tile, 32 x 16; warps and stages
#: mean nothing to the interpreter, and the decode tiles are the same), so these are the rows that run that
#: kernel in distinct ways (the tile's edges against prompt, chunk and window sizes, short rows over cached
#: contexts, no causal mask). The NVIDIA plugin's interpreter run checks the rest (head sizes, decode, KV
#: block sizes, mixed-batch row order, dtypes, rotary, soft-cap, the KV write, the row-wise ops, MoE, GEMMs)
#: on the same kernels
OP_LEVEL = [
    "attention.prefill", "attention.chunked_prefill", "attention.short_rows", "attention.sliding_window",
    "attention.non_causal",
]  # fmt: skip
HAS_ROCM_GPU = getattr(torch.version, "hip", None) is not None and torch.cuda.device_count() > 0


def installed() -> bool:
    """Whether the ``engine-plugin-amd`` distribution (and so its entry point) is installed."""
    try:
        importlib.metadata.distribution("engine-plugin-amd")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(HAS_ROCM_GPU, reason="on an AMD GPU, run `engine conformance --device rocm` instead")
def test_op_level_suite_in_interpreter_with_amd_launch_parameters() -> None:
    env = dict(os.environ, ENGINE_AMD_INTERPRET="1", TRITON_INTERPRET="1", **SUITE_ENV)
    if not installed():
        # registered in-process where the plugin is importable but its entry point is not installed
        env["ENGINE_CONFORMANCE_PLUGIN_MODULES"] = "engine_plugin_amd.plugin"
    args = [sys.executable, "-m", "pytest", str(suite_dir()), "-q", "--no-header", "-p", "no:cacheprovider", "--device", "rocm"]
    # strict: a check that cannot run in the interpreter fails here rather than skipping unseen
    args.append("--conformance-strict")
    for cap in OP_LEVEL:
        args += ["--capability", cap]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
    assert proc.returncode == 0, f"conformance (interpreter, rocm) failed:\n{tail}"
    assert " passed" in tail and "failed" not in tail

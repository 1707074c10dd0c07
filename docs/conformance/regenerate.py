"""Regenerate the committed conformance reports of the plugins that run on this machine's CPU.

Each report keeps its hand-written preface (everything above its ``- plugin:`` line, which says what the
run does and does not cover) and gets a fresh generated part. The NVIDIA report comes from a GPU run
(``engine conformance --device cuda --report docs/conformance/nvidia-h200.md``).

Every run is strict (``--strict``): a check that cannot run here fails instead of being reported "not
runnable here", so a published report never hides one; the report is written either way.

Usage (repository root): ``python docs/conformance/regenerate.py [cpu|rocm|npu|tpu ...]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OP_LEVEL = ["attention", "kv_write", "block_cache", "ops", "gemm", "moe", "lora", "graph_capture", "contract"]

#: device -> (report file, environment, extra pytest arguments)
REPORTS: dict[str, tuple[str, dict[str, str], list[str]]] = {
    "cpu": ("cpu.md", {}, []),
    "rocm": (
        "amd-rocm-interpreter.md",
        {"ENGINE_AMD_INTERPRET": "1", "TRITON_INTERPRET": "1"},
        [arg for cap in OP_LEVEL for arg in ("--capability", cap)],
    ),
    "npu": ("ascend-cpu-glue.md", {"ENGINE_ASCEND_KERNELS": "reference"}, []),
    "tpu": ("tpu-jax-cpu.md", {"ENGINE_TPU_ALLOW_CPU": "1"}, []),
}


def regenerate(device: str) -> int:
    """Run the suite for ``device`` and splice its report under the existing preface; the suite's exit code."""
    name, env, extra = REPORTS[device]
    target = HERE / name
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / name
        command = [
            sys.executable, "-m", "engine_conformance.runner", "--device", device, "--strict", "--report", str(fresh)
        ]  # fmt: skip
        code = subprocess.call([*command, *(["--", *extra] if extra else [])], env={**os.environ, **env})
        generated = fresh.read_text(encoding="utf-8").splitlines(keepends=True)
    start = next(i for i, line in enumerate(generated) if line.startswith("- plugin:"))
    old = target.read_text(encoding="utf-8").splitlines(keepends=True) if target.exists() else []
    end = next((i for i, line in enumerate(old) if line.startswith("- plugin:")), None)
    preface = old[:end] if end is not None else generated[:start]
    target.write_text("".join(preface + generated[start:]), encoding="utf-8")
    print(f"{device}: wrote {target} (suite exit code {code})")
    return code


def main(argv: list[str]) -> int:
    """Regenerate the reports of the devices named (default: all of them); the worst suite exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("devices", nargs="*", metavar="DEVICE", help=f"any of {list(REPORTS)} (default: all)")
    devices = parser.parse_args(argv).devices or list(REPORTS)
    unknown = [d for d in devices if d not in REPORTS]
    if unknown:
        parser.error(f"unknown device(s) {unknown}; known: {list(REPORTS)}")
    return max(regenerate(device) for device in devices)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The CPU plugin's C kernels with their AMX tile kernels enabled, for the tests that exercise those; the
caller is skipped where the CPU, the OS or the toolchain does not allow them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_plugin_cpu.native_build import amx_usable, load_native
from engine_plugin_cpu.native_kernels import NativeKernels


def amx_kernels(threads: int = 2, torch_threads: bool = True) -> Iterator[NativeKernels]:
    """Yields kernels whose ``amx`` is set (a fixture's body: ``yield from amx_kernels()``), closing them
    after; skips the test where AMX-BF16 is missing, turned off (``ENGINE_CPU_AMX=0``) or refused.
    ``torch_threads=False`` keeps the kernels on their own pool instead of torch's OpenMP team."""
    if not amx_usable():
        pytest.skip("this CPU has no AMX-BF16 tiles (or ENGINE_CPU_AMX=0)")
    loaded = load_native()
    if loaded.lib is None:
        pytest.skip(f"C kernels unavailable: {loaded.reason}")
    kernels = NativeKernels(loaded.lib, threads=threads, amx=True, torch_threads=torch_threads)
    if not kernels.amx:
        kernels.close()
        pytest.skip("the OS refused the AMX tile state")
    try:
        yield kernels
    finally:
        kernels.close()

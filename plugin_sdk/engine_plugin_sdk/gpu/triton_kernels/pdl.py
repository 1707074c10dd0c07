"""Programmatic dependent launch (PDL, CUDA compute capability 9.0+): each kernel may start while the one
before it in the stream drains, and waits only where it first reads what that kernel wrote.

Every kernel here takes a ``USE_PDL`` flag and calls :func:`pdl_begin` before its first read of data an
earlier kernel produced (the GEMV first issues its weight loads, which nothing in the step writes). Each
program of a kernel that uses PDL waits unconditionally before it ends, so a kernel never completes
before its predecessor does: a later kernel's wait therefore covers every earlier one too (the chain is
transitive), whether the kernels between are Triton's, cuBLAS's or copies. Kernels launched without the
PDL attribute (any other backend, the interpreter, or PDL off) get ``USE_PDL=False`` and compile as before.

The switch is process-wide and applies to CUDA-graph capture only: the platform says once whether the GPU
has PDL (:attr:`KernelTuning.use_pdl`, :func:`configure`), the graph capture turns it on while it records
(:func:`for_capture`), and the launchers read it at each launch, so the graphs hold the PDL edges. Eager
launches stay ordinary: that is where it pays (an H200's batch-1 decode graphs, 2026-11-29: 231.4 ->
239.2 tok/s), while eager batch-1 decode measured slower with PDL launches (38-45 against 66-67 tok/s,
host-bound and noisy; benchmarks/nvidia_h200_profile.py variants --eager).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = os.environ.get("TRITON_INTERPRET", "") != "1"
except ImportError:  # an older Triton: launches stay ordinary (the flag is then always False)
    AVAILABLE = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass

_wanted = False  # the GPU has PDL and the platform asked for it
_active = False  # launches use it now (inside a graph capture)


def configure(enabled: bool) -> bool:
    """Say whether graph captures may use PDL (only where Triton supports it); returns the new setting."""
    global _wanted
    _wanted = bool(enabled) and AVAILABLE
    return _wanted


def enabled() -> bool:
    """Whether graph captures use PDL."""
    return _wanted


@contextlib.contextmanager
def for_capture() -> Iterator[None]:
    """Within the block, launches use PDL if :func:`configure` enabled it (the graph capture's warm-up runs
    and the capture itself)."""
    global _active
    before = _active
    _active = _wanted
    try:
        yield
    finally:
        _active = before


def active() -> bool:
    """Whether launches use PDL now (inside a graph capture where the GPU has it)."""
    return _active


def launch_options() -> dict:
    """The kernel flag and launch option for the current state: splice into a launch's keyword arguments."""
    return {"USE_PDL": True, "launch_pdl": True} if _active else {"USE_PDL": False}


@triton.jit
def pdl_begin(USE_PDL: tl.constexpr):
    """Let the next kernel's programs start, then wait until the previous kernel's writes are visible."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()

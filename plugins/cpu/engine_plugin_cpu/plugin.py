"""Pluggy hooks of the CPU plugin; importing this module must stay cheap (no torch at import time)."""

from __future__ import annotations

import os
from typing import Any

from engine_plugin_sdk import hookimpl

ENGINE_PLUGIN_API = ">=2.0,<3"

#: environment variables that mean "the user chose the thread count; leave torch alone"
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: our own override, in case a user wants a different count without touching OpenMP's variable
ENGINE_THREADS_ENV = "ENGINE_CPU_THREADS"


@hookimpl
def engine_register_platforms() -> list[type]:
    from engine_plugin_cpu.platform import CpuPlatform

    return [CpuPlatform]


@hookimpl
def engine_configure(platform: Any, config: Any) -> None:
    """Use every core this process may run on for torch's intra-op pool.

    Only acts when the selected platform is ours, and never overrides a count the user chose through
    ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``; ``ENGINE_CPU_THREADS`` sets the count explicitly.
    """
    from engine_plugin_cpu.platform import CpuPlatform

    if not isinstance(platform, CpuPlatform):
        return
    threads = choose_thread_count(os.environ)
    if threads is None:
        return
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def usable_cores() -> int:
    """Cores this process is allowed to run on (affinity mask), falling back to the CPU count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # sched_getaffinity is Linux-only
        return max(1, os.cpu_count() or 1)


def choose_thread_count(environ: Any) -> int | None:
    """The intra-op thread count to set, or None to leave torch's setting alone.

    Raises:
        ValueError: if ``ENGINE_CPU_THREADS`` is not a positive integer.
    """
    explicit = environ.get(ENGINE_THREADS_ENV)
    if explicit:
        if not explicit.strip().isdigit() or int(explicit) < 1:
            raise ValueError(f"{ENGINE_THREADS_ENV} must be a positive integer, got {explicit!r}")
        return int(explicit)
    if any(environ.get(name) for name in THREAD_ENV_VARS):
        return None
    return usable_cores()

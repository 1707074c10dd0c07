"""Settings every test tree shares (core, plugins, conformance)."""

from __future__ import annotations

import os

import pytest

#: the CPU plugin's KV budget in GiB for engines that name none (``engine_plugin_cpu.platform.KVCACHE_SPACE_ENV``)
KVCACHE_SPACE_ENV = "ENGINE_CPU_KVCACHE_SPACE"


def pytest_configure(config: pytest.Config) -> None:
    # The CPU's default KV budget (2 GiB) is zeroed at every engine start; a test's engine that names no
    # budget takes 256 MiB instead (an embedded-model engine still fits 5,000 float32 tokens), as do the
    # servers and ranks it starts, which inherit the variable. On a VM that backs memory when it is first
    # touched, zeroing 2 GiB took 20 seconds.
    os.environ.setdefault(KVCACHE_SPACE_ENV, "0.25")

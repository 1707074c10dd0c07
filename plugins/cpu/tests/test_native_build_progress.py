"""The first start says that it compiles the C kernels, how long that usually takes, and how long it took."""

from __future__ import annotations

import logging

import pytest

from engine_plugin_cpu.native_build import load_native, native_prerequisites


def test_compiling_says_what_it_does_and_how_long_it_took(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    if native_prerequisites():
        pytest.skip(f"no C kernels on this machine: {native_prerequisites()}")
    monkeypatch.setenv("ENGINE_CPU_KERNEL_CACHE", str(tmp_path))
    caplog.set_level(logging.INFO, logger="engine_plugin_cpu.native_build")
    assert load_native().lib is not None
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("compiling the CPU kernels (first start only, about ") for m in messages), messages
    assert any(m.startswith("compiled the CPU kernels in ") and str(tmp_path) in m for m in messages), messages
    caplog.clear()
    assert load_native().lib is not None  # the second start reuses the library, silently
    assert not [r for r in caplog.records if "compil" in r.getMessage()]

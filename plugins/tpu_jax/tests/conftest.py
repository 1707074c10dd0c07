"""Fixtures of the TPU/JAX plugin's tests: the explicit CPU-backend switch and a tiny random Llama."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_plugin_tpu.platform import ALLOW_CPU_ENV


@pytest.fixture(autouse=True)
def allow_jax_cpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests run the plugin on JAX's CPU backend: that needs the explicit, labelled switch."""
    monkeypatch.setenv(ALLOW_CPU_ENV, "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, object]]:
    """A saved two-layer random Llama (vocab 128, head 64, GQA) and its HF model."""
    from engine_plugin_sdk.testing import build_tiny_llama

    folder = tmp_path_factory.mktemp("tiny_llama")
    yield folder, build_tiny_llama(folder, head_dim=64, seed=3)


@pytest.fixture
def make_llm() -> Callable[..., Any]:
    """Builds an ``engine.LLM`` on a device: ``make_llm(folder, device, **kwargs)``."""
    from engine import LLM

    def build(folder: Path, device: str, **kwargs: Any) -> Any:
        return LLM(model=str(folder), device=device, **kwargs)

    return build

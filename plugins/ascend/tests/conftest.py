"""Registers the conformance suite's marker, which the suite's tiny-model helpers carry when imported here."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "capability(name): the plugin capability a conformance test checks")

"""Wires the suite's pytest plugin into plain ``pytest`` runs (see :mod:`engine_conformance.pytest_plugin`)."""

from __future__ import annotations

from engine_conformance.pytest_plugin import (  # noqa: F401  (pytest finds hooks and fixtures by name)
    caps,
    device,
    platform,
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_generate_tests,
    pytest_runtest_makereport,
    pytest_sessionstart,
    pytest_terminal_summary,
)

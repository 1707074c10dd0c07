"""The suite catches wrong backends: each deliberately broken plugin fails, naming the broken capability."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_conformance.broken_plugins import EXPECTED_FAILURES
from engine_conformance.runner import FAIL, PASS, run_conformance


@pytest.mark.parametrize("module", sorted(EXPECTED_FAILURES))
def test_broken_plugin_fails_the_named_capability(
    module: str, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    device, capability = EXPECTED_FAILURES[module]
    report = tmp_path / "report.json"
    code = run_conformance(
        device,
        None,
        str(report),
        ["--plugin-module", f"engine_conformance.broken_plugins.{module}", "--capability", capability],
    )
    assert code == 1
    rows = {row["name"]: row for row in json.loads(report.read_text())["capabilities"]}
    assert rows[capability]["status"] == FAIL
    assert rows[capability]["detail"].startswith(capability), rows[capability]["detail"]
    table = capfd.readouterr().out
    assert any(line.startswith(capability) and " fail " in line for line in table.splitlines())


def test_broken_plugin_leaves_unrelated_capabilities_passing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # registered through the environment variable instead of --plugin-module
    monkeypatch.setenv(
        "ENGINE_CONFORMANCE_PLUGIN_MODULES", "engine_conformance.broken_plugins.gemm_drops_bias"
    )
    report = tmp_path / "report.json"
    assert (
        run_conformance("broken-bias", None, str(report), ["--capability", "ops", "--capability", "kv_write"])
        == 0
    )
    statuses = {row["name"]: row["status"] for row in json.loads(report.read_text())["capabilities"]}
    assert statuses and set(statuses.values()) == {PASS}

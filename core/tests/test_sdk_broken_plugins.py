"""The suite catches wrong backends: each deliberately broken plugin fails, naming the broken capability."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine_conformance.broken_plugins import EXPECTED_FAILURES
from engine_conformance.runner import FAIL, PASS, run_conformance


def _run_broken(module: str, report: Path) -> int:
    device, capability = EXPECTED_FAILURES[module]
    args = ["--plugin-module", f"engine_conformance.broken_plugins.{module}", "--capability", capability]
    return run_conformance(device, None, str(report), args)


@pytest.fixture(scope="module")
def broken_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, dict]]:
    """Every broken plugin's suite run, two at a time (each is a child process: the runs would otherwise
    leave one of CI's two cores idle): module -> (exit code, report rows by name)."""
    folder = tmp_path_factory.mktemp("broken")

    def run(module: str) -> tuple[str, tuple[int, dict]]:
        report = folder / f"{module}.json"
        code = _run_broken(module, report)
        rows = {row["name"]: row for row in json.loads(report.read_text())["capabilities"]} if report.exists() else {}
        return module, (code, rows)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, sorted(EXPECTED_FAILURES)))


@pytest.mark.parametrize("module", sorted(EXPECTED_FAILURES))
def test_broken_plugin_fails_the_named_capability(module: str, broken_runs: dict[str, tuple[int, dict]]) -> None:
    _, capability = EXPECTED_FAILURES[module]
    code, rows = broken_runs[module]
    assert code == 1
    assert rows[capability]["status"] == FAIL
    assert rows[capability]["detail"].startswith(capability), rows[capability]["detail"]


def test_the_failing_row_is_printed_with_its_capability(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    module = "ignores_block_table"
    _, capability = EXPECTED_FAILURES[module]
    assert _run_broken(module, tmp_path / "report.json") == 1
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

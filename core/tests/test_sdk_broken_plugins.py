"""The suite catches wrong backends: each deliberately broken plugin fails, naming the broken capability."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_conformance.broken_plugins import EXPECTED_FAILURES
from engine_conformance.runner import FAIL, NOT_CLAIMED, PASS, run_conformance, run_suite, summarize


def _run_broken(module: str, report: Path) -> int:
    device, capability = EXPECTED_FAILURES[module]
    args = ["--plugin-module", f"engine_conformance.broken_plugins.{module}", "--capability", capability]
    return run_conformance(device, None, str(report), args)


@pytest.fixture(scope="module")
def broken_runs() -> dict[str, tuple[bool, dict]]:
    """Every broken plugin's named capability, all plugins loaded in the same two suite processes (a process
    per plugin spent most of its time starting): module -> (whether the run failed, its device's rows)."""
    args = []
    for module, (device, capability) in sorted(EXPECTED_FAILURES.items()):
        args += ["--plugin-module", f"engine_conformance.broken_plugins.{module}", "--only", f"{device}={capability}"]
    code, results = run_suite(None, args, workers=2)
    assert results is not None, f"the suite did not run (pytest exit code {code})"
    runs = {}
    for module, (device, _) in EXPECTED_FAILURES.items():
        tests = [t for t in results["tests"] if t["device"] == device]
        rows = {row.name: row for row in summarize(tests)}
        runs[module] = (any(t["outcome"] == "failed" for t in tests), rows)
    return runs


@pytest.mark.parametrize("module", sorted(EXPECTED_FAILURES))
def test_broken_plugin_fails_the_named_capability(module: str, broken_runs: dict[str, tuple[bool, dict]]) -> None:
    _, capability = EXPECTED_FAILURES[module]
    failed, rows = broken_runs[module]
    assert failed
    assert rows[capability].status == FAIL
    assert rows[capability].detail.startswith(capability), rows[capability].detail


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


def test_lora_slot_zero_scale_fails_every_row_with_adapters_and_only_those(tmp_path: Path) -> None:
    # a step without adapters cannot show the scale bug: that row passes, every row that reads slots fails
    # (but the recorded-graph one: the reference platform records no graphs)
    module = "lora_scale_of_slot_zero"
    device, _ = EXPECTED_FAILURES[module]
    report = tmp_path / "report.json"
    args = ["--plugin-module", f"engine_conformance.broken_plugins.{module}", "--capability", "lora.add"]
    assert run_conformance(device, None, str(report), args) == 1
    statuses = {row["name"]: row["status"] for row in json.loads(report.read_text())["capabilities"]}
    for dtype in ("float32", "bfloat16"):
        assert statuses.pop(f"lora.add.no_adapter.{dtype}") == PASS
        assert statuses.pop(f"lora.add.graph_replay.{dtype}") == NOT_CLAIMED
    assert len(statuses) == 8 and set(statuses.values()) == {FAIL}, statuses


def test_graph_collectives_taped_at_capture_fail_a_replay(broken_runs: dict[str, tuple[bool, dict]]) -> None:
    # its eager collectives are right (the other distributed rows pass for it): what fails must be a replay,
    # whose collectives handed back what they exchanged while recording
    failed, rows = broken_runs["collectives_baked_into_graphs"]
    detail = rows["distributed.graph_capture"].detail
    assert failed and "replay 1 of bucket" in detail and "out of tolerance" in detail, detail


def test_graph_collectives_row_passes_graphs_that_replay_their_collectives() -> None:
    # the control: core/tests' cpu-graphs platform re-runs each step, gloo collectives included, over its
    # static inputs at every replay (what a correct graph does), so the row must pass for it, not just run
    args = ["--plugin-module", "lockstep_graph_plugin", "--capability", "distributed.graph_capture"]
    code, results = run_suite("cpu-graphs", args, strict=True)
    assert results is not None, f"the suite did not run (pytest exit code {code})"
    rows = {row.name: row for row in summarize(results["tests"])}
    assert code == 0 and rows["distributed.graph_capture"].status == PASS, rows

"""``engine plugin new``: the scaffolded package installs with pip and passes the whole conformance suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_conformance.runner import FAIL, NOT_RUNNABLE, run_conformance
from engine_plugin_sdk.scaffold import scaffold_plugin


def test_scaffold_writes_a_complete_project(tmp_path: Path) -> None:
    project = scaffold_plugin("acme-npu", str(tmp_path))
    assert project == tmp_path / "engine-plugin-acme-npu"
    files = {p.relative_to(project).as_posix() for p in project.rglob("*") if p.is_file()}
    assert files == {
        "pyproject.toml",
        "README.md",
        "engine_plugin_acme_npu/__init__.py",
        "engine_plugin_acme_npu/plugin.py",
        "engine_plugin_acme_npu/platform.py",
        "tests/test_conformance.py",
    }
    pyproject = (project / "pyproject.toml").read_text()
    assert (
        'acme-npu = "engine_plugin_acme_npu.plugin"' in pyproject
        and 'name = "engine-plugin-acme-npu"' in pyproject
    )
    assert "class AcmeNpuPlatform(Platform)" in (project / "engine_plugin_acme_npu/platform.py").read_text()
    assert "${" not in "".join(p.read_text() for p in project.rglob("*") if p.is_file())
    for source in project.rglob("*.py"):
        compile(source.read_text(), str(source), "exec")


def test_scaffold_rejects_bad_names_and_existing_folders(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid plugin name 'Bad Name'"):
        scaffold_plugin("Bad Name", str(tmp_path))
    with pytest.raises(ValueError, match="belongs to the official plugin engine-plugin-nvidia"):
        scaffold_plugin("cuda", str(tmp_path))
    scaffold_plugin("twice", str(tmp_path))
    with pytest.raises(FileExistsError, match="already exists"):
        scaffold_plugin("twice", str(tmp_path))


@pytest.mark.slow
def test_scaffolded_plugin_installs_and_passes_conformance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = scaffold_plugin("scaffoldtest", str(tmp_path / "src"))
    site = tmp_path / "site"
    # into a private --target folder, so that the test leaves the environment as it found it
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(project),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    lint = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", str(project)],
        capture_output=True,
        text=True,
    )
    assert lint.returncode == 0 or "No module named ruff" in lint.stderr, lint.stdout
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    report_md, report_json = tmp_path / "report.md", tmp_path / "report.json"
    assert run_conformance("scaffoldtest", str(report_md), str(report_json)) == 0
    payload = json.loads(report_json.read_text())
    rows = {row["name"]: row["status"] for row in payload["capabilities"]}
    assert FAIL not in rows.values() and NOT_RUNNABLE not in rows.values(), rows
    assert rows["e2e.greedy"] == "pass" and rows["attention.large_block_index"] == "pass"
    assert payload["platforms"][0]["distribution"] == "engine-plugin-scaffoldtest"
    markdown = report_md.read_text()
    assert (
        "# Conformance report: device `scaffoldtest`" in markdown
        and "| `attention.decode` | pass |" in markdown
    )

"""The conformance runner: folding test outcomes into capability rows, and clear errors."""

from __future__ import annotations

import json
import os

from engine_conformance.runner import (
    FAIL,
    NOT_CLAIMED,
    NOT_RUNNABLE,
    PASS,
    format_markdown,
    format_table,
    run_conformance,
    summarize,
)


def outcome(capability: str, result: str, message: str = "", **props: str) -> dict:
    return {
        "nodeid": f"t::{capability}::{len(message)}",
        "capability": capability,
        "device": "x",
        "outcome": result,
        "message": message,
        "properties": props,
    }


def test_summarize_folds_tests_into_capability_rows() -> None:
    rows = summarize(
        [
            outcome("attention.decode", "passed"),
            outcome("attention.decode", "failed", "attention.decode: 3/9 elements out of tolerance"),
            outcome("attention.prefill", "passed"),
            outcome("attention.head_size.80", "skipped", "not claimed: head size 80"),
            outcome(
                "attention.large_block_index", "skipped", "not runnable here: needs 8.0 GiB; 2.0 GiB free"
            ),
            outcome("graph_capture", "passed", not_claimed="no graphs; the eager fallback was checked"),
        ]
    )
    got = {r.name: (r.status, r.detail) for r in rows}
    assert got == {
        "attention.decode": (FAIL, "attention.decode: 3/9 elements out of tolerance"),
        "attention.prefill": (PASS, ""),
        "attention.head_size.80": (NOT_CLAIMED, "head size 80"),
        "attention.large_block_index": (NOT_RUNNABLE, "needs 8.0 GiB; 2.0 GiB free"),
        "graph_capture": (NOT_CLAIMED, "no graphs; the eager fallback was checked"),
    }
    table = format_table(rows)
    assert "1 pass, 1 fail, 2 not claimed, 1 not runnable here" in table
    markdown = format_markdown(
        "x",
        rows,
        [
            {
                "name": "x",
                "plugin": "p",
                "distribution": "engine-plugin-x",
                "version": "1.2",
                "api_spec": ">=2.0,<3",
                "capabilities": None,
            }
        ],
    )
    assert "`engine-plugin-x 1.2`" in markdown and "| `attention.decode` | fail |" in markdown


def test_unknown_device_is_a_clear_usage_error(capfd) -> None:
    code = run_conformance("no-such-device-xyz", None, None)
    captured = capfd.readouterr()
    assert code == 4
    assert "no installed plugin provides device 'no-such-device-xyz'" in captured.out + captured.err


def test_attention_matrix_cells_fold_into_one_table() -> None:
    rows = summarize(
        [
            outcome("attention.decode", "passed"),
            outcome("attention.matrix.float32.float32.decode.plain", "passed"),
            outcome("attention.matrix.bfloat16.float32.decode.plain", "passed"),
            outcome(
                "attention.matrix.float32.float32.decode.window",
                "failed",
                "attention.matrix.float32.float32.decode.window: 3/9 elements out of tolerance",
            ),
            outcome("attention.matrix.bfloat16.float32.decode.window", "skipped", "not claimed: no windows"),
        ]
    )
    table = format_table(rows)
    lines = table.splitlines()
    # a failing cell keeps its own line with its detail; passing cells appear only in the grid
    assert any(
        line.startswith("attention.matrix.float32.float32.decode.window") and " fail " in line
        for line in lines
    )
    assert not any(line.startswith("attention.matrix.float32.float32.decode.plain") for line in lines)
    grid = lines[lines.index(next(line for line in lines if line.startswith("shape / feature"))) :]
    assert "float32 / float32" in grid[0] and "bfloat16 / float32" in grid[0]
    assert grid[1].split() == ["decode", "/", "plain", "pass", "pass"]
    assert grid[2].split() == ["decode", "/", "window", "FAIL", "n/c"]
    assert "3 pass, 1 fail, 1 not claimed, 0 not runnable here" in table
    markdown = format_markdown("x", rows, [])
    assert "| `attention.decode` | pass |" in markdown
    assert "## Attention coverage matrix" in markdown
    assert "| decode / window | FAIL | n/c |" in markdown
    assert "| `attention.matrix.float32.float32.decode.window` | fail |" in markdown
    assert "| `attention.matrix.float32.float32.decode.plain` |" not in markdown


UNAVAILABLE_PLUGIN = """
from engine.interfaces.platform import DetectResult
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class AbsentPlatform(ReferencePlatform):
    name = "absent-device"

    @classmethod
    def detect(cls) -> DetectResult:
        return DetectResult(False, "the test's device is never present")


@hookimpl
def engine_register_platforms() -> list[type]:
    return [AbsentPlatform]
"""


def test_strict_fails_what_cannot_run_here(tmp_path, monkeypatch, capfd) -> None:
    (tmp_path / "absent_device_plugin.py").write_text(UNAVAILABLE_PLUGIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    args = ["--plugin-module", "absent_device_plugin", "--capability", "attention.decode"]
    report = tmp_path / "r.json"
    assert run_conformance("absent-device", None, str(report), args) == 0
    rows = json.loads(report.read_text())["capabilities"]
    assert {r["status"] for r in rows} == {NOT_RUNNABLE}
    assert "0 fail, 0 not claimed, 2 not runnable here" in capfd.readouterr().out
    assert run_conformance("absent-device", None, str(report), args, strict=True) == 1
    rows = json.loads(report.read_text())["capabilities"]
    assert {r["status"] for r in rows} == {FAIL}
    assert rows[0]["detail"].startswith(
        "strict conformance: not runnable here: absent-device is not available"
    )


def test_workers_share_the_suite_and_merge_in_suite_order(tmp_path) -> None:
    # two tests over three workers: one shard draws none (pytest's "nothing selected" is no failure there)
    args = ["--capability", "attention.decode"]
    one, three = tmp_path / "one.json", tmp_path / "three.json"
    assert run_conformance("cpu", None, str(one), args, strict=True) == 0
    assert run_conformance("cpu", None, str(three), args, strict=True, workers=3) == 0
    serial, sharded = json.loads(one.read_text()), json.loads(three.read_text())
    assert len(serial["tests"]) == 2
    assert [t["nodeid"] for t in sharded["tests"]] == [t["nodeid"] for t in serial["tests"]]
    assert [t["index"] for t in sharded["tests"]] == [0, 1]
    assert {t["outcome"] for t in sharded["tests"]} == {"passed"}
    assert sharded["capabilities"] == serial["capabilities"]
    assert sharded["platforms"] == serial["platforms"]

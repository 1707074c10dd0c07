"""The conformance runner: folding test outcomes into capability rows, and clear errors."""

from __future__ import annotations

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

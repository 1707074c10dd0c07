"""``engine conformance --device X``: run the suite for one plugin and report capability by capability.

The suite runs in a child pytest process (so a crashing kernel cannot take the caller down) with
:mod:`engine_conformance.collector` recording each test's capability; this module folds those results
into one row per capability: pass, fail, not claimed, or not runnable here (with why), printed as a
table and optionally written as Markdown and JSON. The attention coverage matrix's cells are drawn as one
table (see :mod:`engine_conformance.matrix_report`). With ``strict`` a check that cannot run here fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine_conformance.collector import RESULTS_ENV
from engine_conformance.matrix_report import matrix_markdown, matrix_text, split_rows

PASS, FAIL, NOT_CLAIMED, NOT_RUNNABLE = "pass", "fail", "not claimed", "not runnable here"
DETAIL_LIMIT = 240


@dataclass(slots=True)
class CapabilityResult:
    """One row of the report.

    Attributes:
        name: the capability, e.g. ``"attention.decode"``.
        status: ``"pass"``, ``"fail"``, ``"not claimed"`` or ``"not runnable here"``.
        detail: why (the first failure, the skip reason, or a note).
        tests: node ids of the tests behind the row.
    """

    name: str
    status: str
    detail: str = ""
    tests: list[str] = field(default_factory=list)


def suite_dir() -> Path:
    """The folder of the installed suite."""
    return Path(__file__).resolve().parent


def summarize(tests: list[dict[str, Any]]) -> list[CapabilityResult]:
    """Fold per-test results (as the collector writes them) into one result per capability, in suite order."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for test in tests:
        grouped.setdefault(test.get("capability") or f"(no capability) {test['nodeid']}", []).append(test)
    rows = []
    for name, group in grouped.items():
        ids = [t["nodeid"] for t in group]
        failed = [t for t in group if t["outcome"] == "failed"]
        passed = [t for t in group if t["outcome"] == "passed"]
        skipped = [t for t in group if t["outcome"] == "skipped"]
        if failed:
            rows.append(CapabilityResult(name, FAIL, _short(failed[0]["message"]), ids))
        elif passed and all(t["properties"].get("not_claimed") for t in passed):
            rows.append(
                CapabilityResult(name, NOT_CLAIMED, _short(passed[0]["properties"]["not_claimed"]), ids)
            )
        elif passed:
            rows.append(CapabilityResult(name, PASS, "", ids))
        elif skipped and all(t["message"].startswith(NOT_CLAIMED) for t in skipped):
            rows.append(CapabilityResult(name, NOT_CLAIMED, _short(_after_colon(skipped[0]["message"])), ids))
        else:
            reason = next((t["message"] for t in skipped if not t["message"].startswith(NOT_CLAIMED)), "")
            rows.append(CapabilityResult(name, NOT_RUNNABLE, _short(_after_colon(reason)), ids))
    return rows


def _after_colon(message: str) -> str:
    for prefix in (NOT_CLAIMED, NOT_RUNNABLE):
        if message.startswith(prefix):
            return message[len(prefix) :].lstrip(": ")
    return message


def _short(message: str) -> str:
    line = " ".join(message.split())
    return line if len(line) <= DETAIL_LIMIT else line[: DETAIL_LIMIT - 3] + "..."


def format_table(rows: list[CapabilityResult]) -> str:
    """A plain-text table for the terminal.

    The attention matrix's cells are folded into one grid after the table; those that did not pass are
    also listed in the table, one line each with their detail.
    """
    matrix, others = split_rows(rows)
    listed = others + [r for r in matrix if r.status != PASS]
    width = max([len("capability"), *(len(r.name) for r in listed)])
    status_width = len(NOT_RUNNABLE)
    lines = [
        f"{'capability'.ljust(width)}  {'result'.ljust(status_width)}  detail",
        "-" * (width + status_width + 12),
    ]
    lines += [f"{r.name.ljust(width)}  {r.status.ljust(status_width)}  {r.detail}".rstrip() for r in listed]
    grid = matrix_text(rows)
    if grid:
        lines += ["", *grid]
    lines.append("")
    lines.append(_counts_line(rows))
    return "\n".join(lines)


def _counts_line(rows: list[CapabilityResult]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in (PASS, FAIL, NOT_CLAIMED, NOT_RUNNABLE)}
    return ", ".join(f"{n} {s}" for s, n in counts.items())


def format_markdown(
    device: str, rows: list[CapabilityResult], platforms: list[dict[str, Any]], strict: bool = False
) -> str:
    """The publishable report: one row per capability, and the attention matrix as one table."""
    import engine
    from engine.plugins.manager import PLUGIN_API_VERSION

    info = next((p for p in platforms if p["name"] == device), platforms[0] if platforms else {})
    dist = info.get("distribution") or f"{info.get('plugin', '?')} (registered in-process)"
    version = f" {info['version']}" if info.get("version") else ""
    matrix, others = split_rows(rows)
    strict_flag = " --strict" if strict else ""
    in_matrix = f" (the {len(matrix)} cells of the attention matrix included)" if matrix else ""
    out = [
        f"# Conformance report: device `{device}`",
        "",
        f"- plugin: `{dist}{version}`, declares plugin API `{info.get('api_spec')}`",
        f"- core: engine {engine.__version__}, plugin API {PLUGIN_API_VERSION}",
        f"- generated by: `engine conformance --device {device}{strict_flag} --report <file>`",
        f"- summary: {_counts_line(rows)}{in_matrix}",
        "",
        "| capability | result | detail |",
        "|---|---|---|",
    ]
    for r in others:
        detail = r.detail.replace("|", "\\|")
        out.append(f"| `{r.name}` | {r.status} | {detail} |")
    grid = matrix_markdown(rows)
    if grid:
        out += ["", *grid]
    caps = info.get("capabilities")
    if caps:
        out += ["", "## Claimed capabilities", ""]
        out += [f"- `{key}`: {json.dumps(value)}" for key, value in sorted(caps.items())]
    return "\n".join(out) + "\n"


#: the op-level capability prefixes without the attention matrix and long-context rows, for CI runs of a
#: plugin's kernels in an interpreter or on reference kernels (the matrix takes minutes there; the
#: published reports run everything)
QUICK_OP_LEVEL = (
    "attention.decode", "attention.prefill", "attention.chunked_prefill", "attention.decode_rows_first",
    "attention.short_rows", "attention.recorded_prefill", "attention.gqa", "attention.mqa", "attention.head_size", "attention.block_size", "attention.dtype",
    "attention.kv_cache_dtype", "attention.sliding_window", "attention.logits_soft_cap",
    "attention.non_causal", "attention.rotary", "attention.rotary.head_norm", "attention.large_block_index", "kv_write", "block_cache", "ops",
    "gemm", "moe", "lora", "graph_capture", "contract", "distributed",
)  # fmt: skip


#: the suite's processes load only the plugins it names: the pytest plugins other packages install (hypothesis,
#: schemathesis, langsmith...) took over half of a short run's start-up
SUITE_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def run_suite(
    device: str | None, extra_pytest_args: list[str] | None = None, strict: bool = False, workers: int = 1
) -> tuple[int, dict[str, Any] | None]:
    """Run the suite in ``workers`` child processes and merge what the collector recorded.

    Args:
        device: the device to run for (``--device``), or None for every platform the run loads (with
            ``--only DEVICE=PREFIX`` pairs in ``extra_pytest_args``, several plugins share one process).
        extra_pytest_args: more pytest arguments.
        strict: ``--conformance-strict``.
        workers: pytest processes sharing the suite (``--conformance-shard``).

    Returns:
        pytest's exit code, and ``{"tests": [...], "platforms": [...]}`` in suite order, or None when a
        process wrote no results (a usage error, a crash).
    """
    with tempfile.TemporaryDirectory(prefix="engine-conformance-") as tmp:
        cmd = [
            sys.executable, "-m", "pytest", str(suite_dir()),
            "-p", "engine_conformance.collector",
            "-p", "no:cacheprovider",
            *(["--device", device] if device is not None else []),
            "-q", "--no-header",
            # the suite's own flag, not pytest's --strict, which also applies the caller's ini strictly
            *(["--conformance-strict"] if strict else []),
            *(extra_pytest_args or []),
        ]  # fmt: skip
        shards = [[f"--conformance-shard={i}/{workers}"] for i in range(workers)] if workers > 1 else [[]]
        paths = [os.path.join(tmp, f"results-{i}.json") for i in range(len(shards))]
        procs = [
            subprocess.Popen([*cmd, *shard], env=dict(os.environ, **{RESULTS_ENV: path}, **SUITE_ENV))
            for shard, path in zip(shards, paths)
        ]
        codes = [proc.wait() for proc in procs]
        # 5 (nothing selected) from a shard that drew no test is no failure when another shard ran some
        ran = [c for c in codes if c != 5] or codes
        code = max(ran)
        if any(not os.path.exists(path) for path in paths):
            return code, None
        results: dict[str, Any] = {"tests": [], "platforms": []}
        for path in paths:
            with open(path, encoding="utf-8") as fh:
                part = json.load(fh)
            results["tests"] += part["tests"]
            results["platforms"] = results["platforms"] or part.get("platforms", [])
        results["tests"].sort(key=lambda t: t.get("index") if t.get("index") is not None else -1)
    return code, results


def run_conformance(
    device: str,
    report_md: str | None = None,
    report_json: str | None = None,
    extra_pytest_args: list[str] | None = None,
    strict: bool = False,
    workers: int = 1,
) -> int:
    """Run the conformance suite for one device and print its capability table.

    Args:
        device: the device, alias or plugin name (as ``--device`` takes it).
        report_md: write the Markdown report here.
        report_json: write the JSON report (rows and every test's outcome) here.
        extra_pytest_args: more pytest arguments, e.g. ``["--capability", "attention"]`` or
            ``["--plugin-module", "my_plugin.hooks"]``.
        strict: a check that cannot run here fails (``--conformance-strict``) instead of being reported
            "not runnable here"; CI and the published reports run this way.
        workers: pytest processes sharing the suite (``--conformance-shard``); on a GPU host most of a
            run is kernel compilation and float64 references on the host's cores, which they share.

    Returns:
        0 when every test passed or was skipped as not claimed / not runnable; pytest's exit code otherwise
        (1: failures, 4: usage error such as an unknown device, 5: nothing selected).
    """
    code, results = run_suite(device, extra_pytest_args, strict, workers)
    if results is None:
        print(f"engine conformance: the suite did not run for device {device!r} (pytest exit code {code})")
        return code or 1
    rows = summarize(results["tests"])
    print()
    print(f"Conformance of device {device!r}:")
    print(format_table(rows))
    if report_md:
        Path(report_md).write_text(
            format_markdown(device, rows, results.get("platforms", []), strict), encoding="utf-8"
        )
    if report_json:
        payload = {
            "device": device,
            "exit_code": code,
            "strict": strict,
            "platforms": results.get("platforms", []),
            "capabilities": [asdict(r) for r in rows],
            "tests": results["tests"],
        }
        Path(report_json).write_text(json.dumps(payload, indent=1), encoding="utf-8")
    if code == 0 and any(r.status == FAIL for r in rows):
        return 1
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m engine_conformance.runner --device X [--strict] [--report F.md] [--json F.json] [-- pytest args]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="engine-conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--device", required=True, help="device, alias or plugin name")
    parser.add_argument("--report", default=None, help="write a Markdown report here")
    parser.add_argument("--json", default=None, help="write a JSON report here")
    parser.add_argument(
        "--strict", action="store_true", help="fail checks that cannot run here instead of reporting them"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="pytest processes sharing the suite (default 1)"
    )
    args, rest = parser.parse_known_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    extra = [a for a in rest if a != "--"]
    return run_conformance(args.device, args.report, args.json, extra, args.strict, args.workers)


if __name__ == "__main__":
    raise SystemExit(main())

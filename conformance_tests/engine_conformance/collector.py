"""A pytest plugin (``-p engine_conformance.collector``) that records each test's capability and outcome.

It writes JSON to the path in ``ENGINE_CONFORMANCE_RESULTS`` at the end of the session:
``{"tests": [{"nodeid", "index", "capability", "device", "outcome", "message", "properties"}]}``, where
``index`` is the test's place in the whole suite's collection order.

``--conformance-shard I/N`` keeps every N-th test from the I-th on (0-based), so that N processes run the
suite between them (the runner's ``--workers``); their results merge back in suite order by ``index``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pytest

RESULTS_ENV = "ENGINE_CONFORMANCE_RESULTS"
_results_key = pytest.StashKey[dict[str, dict[str, Any]]]()
_index_key = pytest.StashKey[dict[str, int]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--conformance-shard", default=None, metavar="I/N",
        help="run only the tests whose collection index is I modulo N (the runner's --workers)",
    )  # fmt: skip


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` as ``(I, N)``.

    Raises:
        pytest.UsageError: not two integers with ``0 <= I < N``.
    """
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--conformance-shard takes I/N, got {text!r}") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"--conformance-shard {text}: I must be in [0, N)")
    return index, count


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_index_key] = {item.nodeid: i for i, item in enumerate(items)}
    shard = config.getoption("--conformance-shard")
    if shard is None:
        return
    index, count = parse_shard(shard)
    keep = [item for i, item in enumerate(items) if i % count == index]
    dropped = [item for i, item in enumerate(items) if i % count != index]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def _message(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        message = str(crash.message).strip()
        for noise in ("Failed: ", "AssertionError: "):
            message = message.removeprefix(noise)
        return message
    return str(longrepr).strip().splitlines()[-1] if longrepr else ""


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_results_key] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    results = item.config.stash[_results_key]
    props = dict(report.user_properties)
    entry = results.setdefault(
        report.nodeid,
        {
            "nodeid": report.nodeid,
            "index": item.config.stash.get(_index_key, {}).get(report.nodeid),
            "capability": props.get("capability"),
            "device": props.get("device"),
            "outcome": "passed",
            "message": "",
            "properties": {},
        },
    )
    entry["properties"].update({k: v for k, v in props.items() if k not in ("capability", "device")})
    # the first phase that fails or skips decides; a teardown error after a pass is a failure too
    if entry["outcome"] != "passed":
        return
    if report.failed:
        entry["outcome"] = "failed"
        entry["message"] = _message(report)
    elif report.skipped:
        entry["outcome"] = "skipped"
        entry["message"] = _message(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    tests = list(session.config.stash.get(_results_key, {}).values())
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(
            {"exitstatus": int(exitstatus), "platforms": _platforms(session.config), "tests": tests},
            fh,
            indent=1,
        )


def _platforms(config: pytest.Config) -> list[dict[str, Any]]:
    from engine_conformance.pytest_plugin import loaded_targets

    out = []
    for target in loaded_targets(config):
        record = target.record
        out.append(
            {
                "name": target.name,
                "plugin": record.name,
                "distribution": record.distribution,
                "version": record.version,
                "api_spec": record.api_spec,
                "available": target.detected.available,
                "reason": target.detected.reason,
                "capabilities": dataclasses.asdict(target.capabilities) if target.capabilities else None,
            }
        )
    return out

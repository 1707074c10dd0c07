"""The pytest side of the suite: options, one test instance per (plugin, claimed feature), capability names.

Options:
    ``--device NAME``: run for one platform (a device name, alias or plugin name); default: every
        installed platform.
    ``--plugin-module MODULE``: register a plugin module in-process (repeatable), besides the
        installed entry points; the environment variable ``ENGINE_CONFORMANCE_PLUGIN_MODULES``
        (comma-separated) does the same.
    ``--capability PREFIX``: run only tests whose capability name starts with PREFIX (repeatable).
    ``--only DEVICE=PREFIX``: run only the tests of platform DEVICE whose capability starts with PREFIX
        (repeatable): one process checks a different capability of each of several plugins.
    ``--strict`` (pytest's own option, which also turns on its strict markers and config) or
        ``--conformance-strict`` (only this): a check that cannot run here fails instead of skipping.
        Only "not claimed" may skip; CI and the published reports run this way.

Without strictness a test skipped for any other reason than "not claimed" still shows as "not runnable
here" in the terminal summary and in the report, with its reason and a count: it never passes silently.

A test names what it checks with ``@pytest.mark.capability("attention.head_size.{head_size}")``;
the braces are filled from the test's parameters. A test skips with a reason starting "not claimed"
or "not runnable here" so that the report can say which.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import pytest

from engine.interfaces.platform import Capabilities, DetectResult, Platform
from engine.plugins.manager import PluginManager, PluginRecord

PLUGIN_MODULES_ENV = "ENGINE_CONFORMANCE_PLUGIN_MODULES"
NOT_CLAIMED = "not claimed"
NOT_RUNNABLE = "not runnable here"
#: head sizes every plugin is asked about; a claimed size outside this list is tested too
STANDARD_HEAD_SIZES = (64, 80, 128, 256)

_targets_key = pytest.StashKey[list["PlatformTarget"]]()
_instances_key = pytest.StashKey[dict[str, Platform]]()
_manager_key = pytest.StashKey[PluginManager]()


@dataclass(frozen=True, slots=True)
class PlatformTarget:
    """One platform of one plugin, as the suite parameterises over it."""

    record: PluginRecord
    cls: type[Platform]
    detected: DetectResult
    capabilities: Capabilities | None
    capabilities_error: str = ""

    @property
    def name(self) -> str:
        return self.cls.name

    def __repr__(self) -> str:
        return f"PlatformTarget({self.name})"


def not_claimed(why: str) -> None:
    """Skip a test because the platform does not claim the feature."""
    pytest.skip(f"{NOT_CLAIMED}: {why}")


def not_runnable(why: str) -> None:
    """Skip a test because it cannot run here (memory, missing hardware, missing optional API)."""
    pytest.skip(f"{NOT_RUNNABLE}: {why}")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine-conformance", "engine plugin conformance")
    group.addoption("--device", action="store", default=None, help="run the conformance suite for one device")
    group.addoption(
        "--plugin-module",
        action="append",
        default=[],
        help="register a plugin module in-process (repeatable)",
    )
    group.addoption(
        "--only",
        action="append",
        default=[],
        metavar="DEVICE=PREFIX",
        help="only run this platform's capabilities with this name prefix (repeatable)",
    )
    group.addoption(
        "--conformance-strict",
        action="store_true",
        default=False,
        help="fail every check that cannot run here instead of skipping it (pytest's --strict does too)",
    )
    group.addoption(
        "--capability",
        action="append",
        default=[],
        help="only run capabilities with this name prefix (repeatable)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "capability(name): the plugin capability a conformance test checks")
    config.addinivalue_line("markers", "slow: end-to-end tests that build and run a model")


def strict_mode(config: pytest.Config) -> bool:
    """Whether a check that cannot run here fails the run (``--conformance-strict`` or pytest's ``--strict``).

    pytest owns ``--strict``: since pytest 9 it sets the ``strict`` ini option, before that it is an
    option of its own; either way the suite reads it rather than registering the name twice.
    """
    if config.getoption("conformance_strict", default=False):
        return True
    try:
        if config.getini("strict") is True:
            return True
    except ValueError:  # pytest < 9 has no "strict" ini option
        pass
    return bool(config.getoption("strict", default=False))


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Under strictness, turn every skip that is not "not claimed" into a failure that keeps its reason.

    ``trylast`` makes this the innermost wrapper, so the collector and pytest's terminal see the
    converted report.
    """
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or not strict_mode(item.config) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if reason.startswith(NOT_CLAIMED):
        return
    if not reason.startswith(NOT_RUNNABLE):
        reason = f"{NOT_RUNNABLE}: {reason}"
    report.outcome = "failed"
    report.longrepr = f"strict conformance: {reason}"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Count the suite's skips by kind, listing each check that could not run here with its reason."""
    claimed, runnable = [], []
    for report in terminalreporter.stats.get("skipped", []):
        props = dict(getattr(report, "user_properties", []))
        if "capability" not in props and "device" not in props:
            continue  # another suite's skip, in a run that collected more than the conformance suite
        reason = _skip_reason(report)
        (claimed if reason.startswith(NOT_CLAIMED) else runnable).append((report.nodeid, reason))
    if not claimed and not runnable:
        return
    terminalreporter.section("engine conformance: skipped checks")
    terminalreporter.write_line(
        f"{len(claimed)} {NOT_CLAIMED}, {len(runnable)} {NOT_RUNNABLE}"
        + ("" if strict_mode(config) else " (run with --strict to fail on the latter)")
    )
    for nodeid, reason in runnable:
        terminalreporter.write_line(f"{nodeid}: {reason}")


def pytest_sessionstart(session: pytest.Session) -> None:
    # resolve --device before collection so that a wrong name is one clear usage error
    if session.config.getoption("--device") is not None:
        conformance_targets(session.config)


def _plugin_modules(config: pytest.Config) -> list[str]:
    from_env = [m.strip() for m in os.environ.get(PLUGIN_MODULES_ENV, "").split(",") if m.strip()]
    return list(config.getoption("--plugin-module") or []) + from_env


def conformance_targets(config: pytest.Config) -> list[PlatformTarget]:
    """The platforms this run checks (computed once per session)."""
    if _targets_key in config.stash:
        return config.stash[_targets_key]
    manager = PluginManager()
    for module in _plugin_modules(config):
        record = manager.register_module(module)
        if record.status != "loaded":
            raise pytest.UsageError(f"plugin module {module!r} was refused: {record.error}")
    device = config.getoption("--device")
    targets = []
    for record, cls, detected in manager.detect_all():
        if device is not None and device not in (cls.name, record.name, *cls.aliases):
            continue
        caps, error = None, ""
        try:
            caps = cls().capabilities()
        except Exception as exc:  # reported per test as a failure, not a crash of collection
            error = f"{cls.__name__}().capabilities() raised {type(exc).__name__}: {exc}"
        targets.append(PlatformTarget(record, cls, detected, caps, error))
    if device is not None and not targets:
        from engine.plugins.selection import DeviceNotAvailableError, select_platform

        try:
            select_platform(device, manager)
            message = f"no platform named {device!r}"
        except DeviceNotAvailableError as exc:
            message = str(exc)
        raise pytest.UsageError(f"--device {device}: {message}")
    config.stash[_targets_key] = targets
    config.stash[_manager_key] = manager
    return targets


def loaded_targets(config: pytest.Config) -> list[PlatformTarget]:
    """The targets of this session if the suite's plugin resolved them, else an empty list."""
    return config.stash.get(_targets_key, [])


def plugin_manager_of(config: pytest.Config) -> PluginManager:
    """The plugin manager the suite loaded (entry points plus ``--plugin-module`` modules)."""
    conformance_targets(config)
    return config.stash[_manager_key]


def _axis_values(axis: str, target: PlatformTarget) -> list[Any]:
    caps = target.capabilities
    if caps is None:
        return ["?"]
    if axis == "dtype_name":
        return list(caps.dtypes)
    if axis == "kv_cache_dtype_name":
        return list(caps.kv_cache_dtypes)
    if axis == "block_size":
        return list(caps.block_sizes)
    if axis == "head_size":
        return sorted(set(STANDARD_HEAD_SIZES) | set(caps.head_sizes))
    if axis == "quant_scheme":
        return list(caps.quant_schemes) or ["any"]
    raise ValueError(f"unknown parameter axis {axis!r}")


AXES = ("dtype_name", "kv_cache_dtype_name", "block_size", "head_size", "quant_scheme")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "platform_target" not in metafunc.fixturenames:
        return
    targets = conformance_targets(metafunc.config)
    axes = [a for a in AXES if a in metafunc.fixturenames]
    params, ids = [], []
    for target in targets:
        for combo in itertools.product(*(_axis_values(a, target) for a in axes)):
            params.append((target, *combo))
            ids.append("-".join([target.name, *map(str, combo)]))
    metafunc.parametrize(["platform_target", *axes], params, ids=ids)


def capability_name(item: pytest.Item) -> str | None:
    """The item's capability, its marker's template filled from the test parameters."""
    marker = item.get_closest_marker("capability")
    if marker is None or not marker.args:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    return str(marker.args[0]).format(**{k: v for k, v in params.items() if k != "platform_target"})


def _only_pairs(config: pytest.Config) -> list[tuple[str, str]]:
    pairs = []
    for text in config.getoption("--only") or []:
        device, sep, prefix = text.partition("=")
        if not sep or not device:
            raise pytest.UsageError(f"--only takes DEVICE=PREFIX, got {text!r}")
        pairs.append((device, prefix))
    return pairs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    prefixes = config.getoption("--capability") or []
    only = _only_pairs(config)
    keep, dropped = [], []
    for item in items:
        name = capability_name(item)
        params = getattr(getattr(item, "callspec", None), "params", {})
        target = params.get("platform_target")
        if name is not None:
            item.user_properties.append(("capability", name))
        if isinstance(target, PlatformTarget):
            item.user_properties.append(("device", target.name))
        if prefixes and not (name and any(name.startswith(p) for p in prefixes)):
            dropped.append(item)
        elif only and not (name and isinstance(target, PlatformTarget) and _selected(only, target, name)):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _selected(pairs: list[tuple[str, str]], target: PlatformTarget, capability: str) -> bool:
    names = (target.name, target.record.name, *target.cls.aliases)
    return any(device in names and capability.startswith(prefix) for device, prefix in pairs)


@pytest.fixture
def platform(platform_target: PlatformTarget, request: pytest.FixtureRequest) -> Platform:
    """The platform instance under test (one per session and platform); skips when absent here."""
    if not platform_target.detected.available:
        not_runnable(f"{platform_target.name} is not available: {platform_target.detected.reason}")
    if platform_target.capabilities is None:
        pytest.fail(platform_target.capabilities_error)
    cache = request.config.stash.setdefault(_instances_key, {})
    if platform_target.name not in cache:
        cache[platform_target.name] = platform_target.cls()
    return cache[platform_target.name]


@pytest.fixture
def caps(platform: Platform, platform_target: PlatformTarget) -> Capabilities:
    """The platform's claims."""
    assert platform_target.capabilities is not None
    return platform_target.capabilities


@pytest.fixture
def device(platform: Platform) -> Any:
    """The torch device the platform's tensors live on."""
    return platform.torch_device()

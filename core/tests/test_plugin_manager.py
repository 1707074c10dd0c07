"""The plugin manager: API-version checks, broken plugins reported by name, allow/deny, device selection."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from engine.interfaces.platform import DetectResult
from engine.plugins.hookspecs import hookimpl
from engine.plugins.manager import PLUGIN_API_VERSION, PluginManager, check_api_compatibility
from engine.plugins.selection import DeviceNotAvailableError, select_platform
from engine_plugin_sdk.reference_platform import ReferencePlatform


def make_plugin_module(
    module_name: str, device: str, api_spec: str | None, available: bool = True
) -> types.ModuleType:
    """A plugin module built in memory: one reference platform called ``device``."""

    class Platform_(ReferencePlatform):
        name = device

        @classmethod
        def detect(cls) -> DetectResult:
            return DetectResult(available, "" if available else "no such hardware in this test")

    module = types.ModuleType(module_name)
    if api_spec is not None:
        module.ENGINE_PLUGIN_API = api_spec

    @hookimpl
    def engine_register_platforms() -> list[type]:
        return [Platform_]

    module.engine_register_platforms = engine_register_platforms
    return module


@pytest.mark.parametrize("spec", [">=2.0,<3", "~=2.0", "==2.*", ">=1.5"])
def test_compatible_specs_are_accepted(spec: str) -> None:
    assert check_api_compatibility("p", spec) == ""


@pytest.mark.parametrize("spec", ["<2.0", ">=1.0,<2", "==1.9", ">=3,<4"])
def test_incompatible_spec_message_names_plugin_and_both_versions(spec: str) -> None:
    message = check_api_compatibility("acme", spec)
    assert "'acme'" in message and spec in message and PLUGIN_API_VERSION in message


def test_missing_and_invalid_specs_are_explained() -> None:
    assert "does not declare ENGINE_PLUGIN_API" in check_api_compatibility("acme", None)
    assert "invalid ENGINE_PLUGIN_API" in check_api_compatibility("acme", "not a version")


def test_incompatible_plugin_is_refused_and_the_others_keep_working() -> None:
    manager = PluginManager(load_entry_points=False)
    good = manager.register_module(make_plugin_module("good_plugin", "good-dev", ">=2.0,<3"))
    old = manager.register_module(make_plugin_module("old_plugin", "old-dev", ">=1.0,<2"))
    assert good.status == "loaded" and [p.name for p in good.platforms] == ["good-dev"]
    assert old.status == "incompatible"
    assert "old_plugin" in old.error and ">=1.0,<2" in old.error and PLUGIN_API_VERSION in old.error
    assert select_platform("good-dev", manager).name == "good-dev"
    with pytest.raises(DeviceNotAvailableError, match="old_plugin could not be loaded: .*plugin API"):
        select_platform("old_plugin", manager)
    assert [c.name for c in manager.platform_classes()] == ["good-dev"]


def test_plugin_without_api_declaration_is_refused() -> None:
    manager = PluginManager(load_entry_points=False)
    record = manager.register_module(make_plugin_module("undeclared", "undeclared-dev", None))
    assert record.status == "incompatible" and "does not declare ENGINE_PLUGIN_API" in record.error


def test_hook_that_raises_is_reported_as_invalid() -> None:
    module = types.ModuleType("raising_plugin")
    module.ENGINE_PLUGIN_API = ">=2.0,<3"

    @hookimpl
    def engine_register_platforms() -> list[type]:
        raise RuntimeError("driver library missing")

    module.engine_register_platforms = engine_register_platforms
    manager = PluginManager(load_entry_points=False)
    record = manager.register_module(module)
    assert record.status == "invalid" and "driver library missing" in record.error
    assert manager.platform_classes() == []


def test_non_platform_return_is_invalid() -> None:
    module = types.ModuleType("bad_return_plugin")
    module.ENGINE_PLUGIN_API = ">=2.0,<3"

    @hookimpl
    def engine_register_platforms() -> list[object]:
        return [object]

    module.engine_register_platforms = engine_register_platforms
    record = PluginManager(load_entry_points=False).register_module(module)
    assert record.status == "invalid" and "non-Platform" in record.error


def test_unavailable_device_says_why() -> None:
    manager = PluginManager(load_entry_points=False)
    manager.register_module(make_plugin_module("absent_plugin", "absent-dev", ">=2.0", available=False))
    with pytest.raises(DeviceNotAvailableError, match="no such hardware in this test"):
        select_platform("absent-dev", manager)


def write_fake_distribution(site: Path, dist: str, entry_points: dict[str, str]) -> None:
    """A dist-info folder with entry points in ``engine.plugins``, as pip would install it."""
    info = site / f"{dist}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n", encoding="utf-8")
    lines = ["[engine.plugins]"] + [f"{name} = {value}" for name, value in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_plugin_whose_import_raises_is_listed_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "crashing_plugin_mod.py").write_text(
        "raise ImportError('libvendor.so: cannot open shared object')\n"
    )
    (tmp_path / "fine_plugin_mod.py").write_text(
        "from engine.plugins.hookspecs import hookimpl\n"
        "ENGINE_PLUGIN_API = '>=2.0,<3'\n"
        "@hookimpl\n"
        "def engine_register_platforms():\n"
        "    from engine_plugin_sdk.reference_platform import ReferenceDevicePlatform\n"
        "    return [ReferenceDevicePlatform]\n"
    )
    write_fake_distribution(
        tmp_path,
        "engine_plugin_fake",
        {"crashing": "crashing_plugin_mod", "fine": "fine_plugin_mod"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    manager = PluginManager(allow=["crashing", "fine"])
    records = {r.name: r for r in manager.records}
    assert records["crashing"].status == "import-error"
    assert "libvendor.so" in records["crashing"].error and "crashing_plugin_mod" in records["crashing"].error
    assert records["crashing"].distribution == "engine_plugin_fake" and records["crashing"].version == "0.1.0"
    assert records["fine"].status == "loaded"
    with pytest.raises(DeviceNotAvailableError, match="plugin crashing could not be loaded: .*libvendor.so"):
        select_platform("crashing", manager)
    assert select_platform("reference", manager).name == "reference"
    monkeypatch.delitem(sys.modules, "fine_plugin_mod", raising=False)


def test_allow_and_deny_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "never_imported_mod.py").write_text("raise SystemExit('must not be imported')\n")
    write_fake_distribution(tmp_path, "engine_plugin_denied", {"denied": "never_imported_mod"})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert all(r.name != "denied" for r in PluginManager(deny=["denied"]).records)
    assert [r.name for r in PluginManager(allow=["nothing-by-this-name"]).records] == []


def test_auto_prefers_the_highest_priority_available_platform() -> None:
    manager = PluginManager(load_entry_points=False)
    low = make_plugin_module("low_plugin", "low-dev", ">=2.0")
    high = make_plugin_module("high_plugin", "high-dev", ">=2.0")
    manager.register_module(low)
    manager.register_module(high)
    high_cls = manager.records[1].platforms[0]
    high_cls.priority = 50
    assert select_platform("auto", manager).name == "high-dev"

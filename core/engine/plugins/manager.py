"""Finds plugins through entry points, checks their API version, and registers their hooks with pluggy."""

from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import importlib_metadata
import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from engine.interfaces.platform import DetectResult, Platform
from engine.plugins import hookspecs

#: the plugin API this core implements; see docs/plugins.md for what minor and major changes mean
PLUGIN_API_VERSION = "2.0"
ENTRY_POINT_GROUP = "engine.plugins"


@dataclass(slots=True)
class PluginRecord:
    """What the manager knows about one plugin, loaded or not.

    Attributes:
        name: the entry-point name.
        distribution: the pip distribution that ships it (None for plugins registered in-process).
        version: that distribution's version.
        status: ``"loaded"``, ``"import-error"``, ``"incompatible"`` or ``"invalid"``.
        error: why it is not loaded, one line.
        platforms: platform classes it registered.
    """

    name: str
    distribution: str | None = None
    version: str | None = None
    status: str = "loaded"
    error: str = ""
    platforms: list[type[Platform]] = field(default_factory=list)
    api_spec: str | None = None


class PluginManager:
    """Loads plugins and answers which platforms exist.

    Args:
        allow: if given, only plugins with these entry-point names are loaded (default: the
            comma-separated ``ENGINE_PLUGINS_ALLOW`` environment variable, if set).
        deny: plugins with these names are skipped (default: ``ENGINE_PLUGINS_DENY``).
        load_entry_points: read the ``engine.plugins`` group (tests turn this off and register by hand).
    """

    def __init__(
        self,
        allow: list[str] | None = None,
        deny: list[str] | None = None,
        load_entry_points: bool = True,
    ) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        if allow is None and os.environ.get("ENGINE_PLUGINS_ALLOW"):
            allow = [n.strip() for n in os.environ["ENGINE_PLUGINS_ALLOW"].split(",") if n.strip()]
        if deny is None:
            deny = [n.strip() for n in os.environ.get("ENGINE_PLUGINS_DENY", "").split(",") if n.strip()]
        self._allow = set(allow) if allow is not None else None
        self._deny = set(deny or ())
        self.records: list[PluginRecord] = []
        if load_entry_points:
            self._load_entry_points()

    @property
    def hook(self) -> Any:
        return self._pm.hook

    def _load_entry_points(self) -> None:
        for ep in sorted(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if (self._allow is not None and ep.name not in self._allow) or ep.name in self._deny:
                continue
            dist = getattr(ep, "dist", None)
            record = PluginRecord(
                name=ep.name,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
            )
            try:
                module = ep.load()
            except Exception as exc:  # a broken plugin must be reported, not take the others down
                record.status = "import-error"
                record.error = f"importing {ep.value} failed: {type(exc).__name__}: {exc}"
                self.records.append(record)
                continue
            self._register(module, record)

    def register_module(self, module: ModuleType | str, name: str | None = None) -> PluginRecord:
        """Register a plugin module in-process (tests, embedded use). Same checks as entry points."""
        if isinstance(module, str):
            module = importlib.import_module(module)
        record = PluginRecord(name=name or module.__name__)
        self._register(module, record)
        return record

    def _register(self, module: ModuleType, record: PluginRecord) -> None:
        self.records.append(record)
        spec = getattr(module, "ENGINE_PLUGIN_API", None)
        record.api_spec = spec
        problem = check_api_compatibility(record.name, spec)
        if problem:
            record.status = "incompatible"
            record.error = problem
            return
        try:
            self._pm.register(module, name=record.name)
            impls = [i for i in self._pm.hook.engine_register_platforms.get_hookimpls() if i.plugin is module]
            platforms: list[type[Platform]] = []
            for impl in impls:
                platforms.extend(impl.function() or [])
        except Exception as exc:  # a plugin whose hooks raise is reported by name like an import error
            if self._pm.is_registered(module):
                self._pm.unregister(module)
            record.status = "invalid"
            record.error = f"registering failed: {type(exc).__name__}: {exc}"
            return
        bad = [p for p in platforms if not (isinstance(p, type) and issubclass(p, Platform) and p.name)]
        if bad:
            self._pm.unregister(module)
            record.status = "invalid"
            record.error = f"engine_register_platforms returned non-Platform values: {bad!r}"
            return
        record.platforms = platforms

    def loaded_records(self) -> list[PluginRecord]:
        return [r for r in self.records if r.status == "loaded"]

    def platform_classes(self) -> list[type[Platform]]:
        """Every platform class of every loaded plugin."""
        return [p for r in self.loaded_records() for p in r.platforms]

    def detect_all(self) -> list[tuple[PluginRecord, type[Platform], DetectResult]]:
        """Run each platform's cheap detection."""
        out = []
        for record in self.loaded_records():
            for cls in record.platforms:
                try:
                    result = cls.detect()
                except Exception as exc:  # detection is a plugin's code; a failure means "unavailable"
                    result = DetectResult(False, f"detect() raised {type(exc).__name__}: {exc}")
                out.append((record, cls, result))
        return out

    def models_by_plugin(self) -> list[tuple[str, dict[str, Any]]]:
        """Each loaded plugin's ``engine_register_models()``, in entry-point name order.

        A plugin whose hook raises or returns something other than a dict is left out with a
        ``RuntimeWarning`` naming it; the other plugins' models stay available.

        Returns:
            ``(plugin name, {architecture: model class})`` pairs; :class:`engine.models.registry.ModelRegistry`
            decides which entries it accepts.
        """
        out: list[tuple[str, dict[str, Any]]] = []
        impls = sorted(self._pm.hook.engine_register_models.get_hookimpls(), key=lambda i: i.plugin_name)
        for impl in impls:
            try:
                models = impl.function()
            except Exception as exc:  # a plugin's bug must not take the core's models down with it
                warnings.warn(
                    f"plugin {impl.plugin_name!r}: engine_register_models raised {type(exc).__name__}: {exc}; "
                    "its models are not available",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            if models is None:
                continue
            if not isinstance(models, dict):
                warnings.warn(
                    f"plugin {impl.plugin_name!r}: engine_register_models returned {type(models).__name__}, "
                    "expected {architecture: model class}; its models are not available",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            out.append((impl.plugin_name, models))
        return out

    def extra_models(self) -> dict[str, Any]:
        """Architectures contributed by plugins, merged (the first plugin keeps a repeated name).

        Build a :class:`engine.models.registry.ModelRegistry` instead to resolve names: it also refuses
        plugin entries that would replace a core architecture.
        """
        merged: dict[str, Any] = {}
        for _, models in self.models_by_plugin():
            for name, model_cls in models.items():
                merged.setdefault(name, model_cls)
        return merged


def check_api_compatibility(name: str, spec: str | None, core_version: str = PLUGIN_API_VERSION) -> str:
    """Return why a plugin declaring ``spec`` cannot load on this core, or ``""`` if it can."""
    if not spec:
        return (
            f"plugin {name!r} does not declare ENGINE_PLUGIN_API (the plugin API versions it supports); "
            f"this core implements plugin API {core_version}"
        )
    try:
        spec_set = SpecifierSet(spec)
    except InvalidSpecifier:
        return f"plugin {name!r} declares an invalid ENGINE_PLUGIN_API {spec!r}"
    if Version(core_version) not in spec_set:
        return (
            f"plugin {name!r} supports plugin API {spec} but this core implements plugin API {core_version}; "
            f"install a version of the plugin built for API {core_version}"
        )
    return ""

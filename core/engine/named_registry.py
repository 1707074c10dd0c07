"""A registry of named factories, with loading of a user's plugin file that adds to it.

The tool-call and reasoning parser registries are both this shape: ``--tool-parser hermes`` picks a
registered class by name, and ``--tool-parser-plugin FILE`` runs a user's file that registers more. Each
registry is an object a function builds (never module state that importing fills), so two servers in
one process, or two tests, never see each other's registrations.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: the file name the module of a loaded plugin file gets in ``sys.modules`` starts with this
_PLUGIN_MODULE_PREFIX = "_engine_parser_plugin_"


class UnknownNameError(ValueError):
    """No entry of a registry has the name asked for; the message lists the names there are.

    Attributes:
        name: the name asked for.
        known: the registered names, sorted.
    """

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        listing = ", ".join(known) if known else "none"
        super().__init__(f"unknown {kind} {name!r}; known {kind}s: {listing}.{hint}")
        self.name = name
        self.known = known


class PluginFileError(RuntimeError):
    """A plugin file could not be loaded: missing, failing on import, or without its hook function."""


class NamedRegistry(Generic[T]):
    """Named entries of one kind (parser classes), plus plugin files that register more.

    Args:
        kind: what an entry is, in words, for error messages (``"tool parser"``).
        plugin_hook: the function a plugin file must define; it is called with this registry.
    """

    def __init__(self, kind: str, plugin_hook: str) -> None:
        self._kind = kind
        self._plugin_hook = plugin_hook
        self._entries: dict[str, T] = {}

    @property
    def kind(self) -> str:
        return self._kind

    def register(self, name: str, entry: T, *, replace: bool = False) -> T:
        """Add ``entry`` under ``name``.

        Args:
            name: the name users select it by (``--tool-parser NAME``); non-empty, no whitespace.
            entry: what the name stands for (a parser class).
            replace: allow taking over a name already registered (a plugin overriding a built-in).

        Returns:
            ``entry``, so that this can be used as a decorator's body.

        Raises:
            ValueError: the name is empty or has whitespace, or is taken and ``replace`` is False.
        """
        if not name or any(ch.isspace() for ch in name):
            raise ValueError(f"a {self._kind} name must be non-empty with no whitespace, got {name!r}")
        if name in self._entries and not replace:
            raise ValueError(f"{self._kind} {name!r} is already registered (pass replace=True to override it)")
        self._entries[name] = entry
        return entry

    def decorator(self, name: str, *, replace: bool = False) -> Callable[[T], T]:
        """``@registry.decorator("name")`` registers the decorated class under ``name``.

        Args:
            name: as for :meth:`register`.
            replace: as for :meth:`register`.

        Returns:
            A decorator that registers its argument and returns it unchanged.
        """

        def _register(entry: T) -> T:
            return self.register(name, entry, replace=replace)

        return _register

    def get(self, name: str) -> T:
        """The entry registered under ``name``.

        Args:
            name: a registered name.

        Returns:
            The entry.

        Raises:
            UnknownNameError: nothing is registered under ``name``; the message lists what is.
        """
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(self._kind, name, self.names()) from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def load_plugin_file(self, path: str | os.PathLike[str]) -> list[str]:
        """Import a user's Python file and call its hook function with this registry.

        The file defines ``def <plugin_hook>(registry) -> None`` and calls ``registry.register(...)``
        in it; importing the file alone registers nothing, so a file loaded into two registries
        registers into both.

        Args:
            path: the plugin file.

        Returns:
            The names the file registered, sorted.

        Raises:
            PluginFileError: the file is missing, raised while importing or registering, or has no
                callable hook; the message names the file and the cause.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise PluginFileError(f"{self._kind} plugin file {path!r} does not exist")
        module = _import_file(path)
        hook = getattr(module, self._plugin_hook, None)
        if not callable(hook):
            raise PluginFileError(
                f"{self._kind} plugin file {path!r} defines no function {self._plugin_hook}(registry); "
                f"it must define one that calls registry.register(name, cls)"
            )
        names_before = dict(self._entries)
        try:
            hook(self)
        except Exception as exc:
            raise PluginFileError(f"{self._kind} plugin file {path!r} failed in {self._plugin_hook}: {exc!r}") from exc
        return sorted(n for n, e in self._entries.items() if names_before.get(n) is not e)


def import_plugin_file(path: str | os.PathLike[str]) -> Any:
    """Import a plugin file as :meth:`NamedRegistry.load_plugin_file` does, registering nothing: another
    process of the engine does this so that objects of the file's classes unpickle there.

    Raises:
        PluginFileError: the file is missing or raised while importing.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PluginFileError(f"plugin file {path!r} does not exist")
    return _import_file(path)


def _import_file(path: str) -> Any:
    """Import ``path`` as a module of its own (named after a hash of its absolute path, so two plugin
    files called ``parser.py`` do not clash) and return it.

    Raises:
        PluginFileError: the file raised while being imported.
    """
    absolute = os.path.abspath(path)
    digest = hashlib.sha1(absolute.encode("utf-8")).hexdigest()[:12]
    module_name = f"{_PLUGIN_MODULE_PREFIX}{digest}"
    spec = importlib.util.spec_from_file_location(module_name, absolute)
    if spec is None or spec.loader is None:
        raise PluginFileError(f"plugin file {path!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    # registered before running, as importlib does, so dataclasses and pickling inside the file work
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise PluginFileError(f"plugin file {path!r} raised while being imported: {exc!r}") from exc
    return module

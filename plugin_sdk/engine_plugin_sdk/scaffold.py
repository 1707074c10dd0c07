"""``engine plugin new NAME``: write a complete plugin package that installs and passes conformance.

The templates live under ``engine_plugin_sdk/templates/plugin``; ``PACKAGE`` in a path becomes the
import package, ``.tmpl`` is dropped, and ``${...}`` placeholders are filled in.
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from string import Template

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
TEMPLATE_SUFFIX = ".tmpl"


def plugin_names(name: str) -> dict[str, str]:
    """The names a plugin called ``name`` gets: device, distribution, import package, platform class.

    Raises:
        ValueError: for a name that is not lower-case letters, digits, ``-`` and ``_``, starting with a letter,
            or that an official plugin owns (``cpu``, ``cuda``, ...).
    """
    if not NAME_PATTERN.match(name or ""):
        raise ValueError(
            f"invalid plugin name {name!r}: use 1-40 lower-case letters, digits, '-' or '_', starting with a letter"
        )
    from engine.plugins.selection import KNOWN_DEVICE_PACKAGES

    if name in KNOWN_DEVICE_PACKAGES:
        raise ValueError(
            f"the device name {name!r} belongs to the official plugin {KNOWN_DEVICE_PACKAGES[name]}; "
            "choose a name of your own, e.g. your company's"
        )
    package_suffix = name.replace("-", "_")
    from engine import __version__ as engine_version
    from engine_plugin_sdk import DEFAULT_API_SPEC

    return {
        "device": name,
        "dist": f"engine-plugin-{name.replace('_', '-')}",
        "package": f"engine_plugin_{package_suffix}",
        "class_name": "".join(part.capitalize() for part in package_suffix.split("_")) + "Platform",
        "api_spec": DEFAULT_API_SPEC,
        "engine_version": engine_version,
    }


def _walk(folder: Traversable, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Traversable]]:
    files = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name == "__pycache__":
            continue
        if entry.is_dir():
            files += _walk(entry, (*prefix, entry.name))
        else:
            files.append(((*prefix, entry.name), entry))
    return files


def scaffold_plugin(name: str, dest_dir: str) -> Path:
    """Create ``dest_dir/engine-plugin-<name>/``: pyproject with the entry point, platform, hooks, tests, README.

    Args:
        name: the device name users will pass to ``--device``.
        dest_dir: the folder to create the project in (created if missing).

    Returns:
        The project folder.

    Raises:
        ValueError: for an invalid name.
        FileExistsError: when the project folder exists and is not empty.
    """
    names = plugin_names(name)
    project = Path(dest_dir) / names["dist"]
    if project.exists() and any(project.iterdir()):
        raise FileExistsError(f"{project} already exists and is not empty; choose another name or folder")
    templates = resources.files("engine_plugin_sdk").joinpath("templates", "plugin")
    written = []
    for parts, source in _walk(templates):
        rel = [names["package"] if p == "PACKAGE" else p for p in parts]
        rel[-1] = rel[-1].removesuffix(TEMPLATE_SUFFIX)
        target = project.joinpath(*rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(Template(source.read_text(encoding="utf-8")).substitute(names), encoding="utf-8")
        written.append(target)
    if not written:
        raise FileNotFoundError(
            f"no plugin templates found under {templates}; the SDK installation is incomplete"
        )
    return project

"""Maps the three import packages onto the fixed top-level folders (core/, plugin_sdk/, conformance_tests/)."""

from __future__ import annotations

import os

from setuptools import setup

ROOTS = {"engine": "core", "engine_plugin_sdk": "plugin_sdk", "engine_conformance": "conformance_tests"}
SKIP = {"tests", "__pycache__"}


def find_packages_under(import_name: str, folder: str) -> tuple[list[str], dict[str, str]]:
    packages, dirs = [], {}
    for here, subdirs, files in os.walk(folder):
        subdirs[:] = [d for d in subdirs if d not in SKIP and not d.startswith(".")]
        if "__init__.py" not in files:
            subdirs[:] = []
            continue
        rel = os.path.relpath(here, folder)
        name = import_name if rel == "." else import_name + "." + rel.replace(os.sep, ".")
        packages.append(name)
        dirs[name] = here
    return packages, dirs


all_packages: list[str] = []
package_dir: dict[str, str] = {}
for name, folder in ROOTS.items():
    pkgs, dirs = find_packages_under(name, folder)
    all_packages += pkgs
    package_dir.update(dirs)

setup(
    packages=all_packages,
    package_dir=package_dir,
    package_data={"engine_plugin_sdk": ["templates/**/*", "templates/*"], "engine_conformance": ["*.py"]},
    include_package_data=True,
)

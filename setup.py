"""The core distribution's three import packages, each in the folder of its name under a fixed top-level one:
``core/engine``, ``plugin_sdk/engine_plugin_sdk`` and ``conformance_tests/engine_conformance``."""

from __future__ import annotations

from setuptools import find_packages, setup

ROOTS = {"engine": "core", "engine_plugin_sdk": "plugin_sdk", "engine_conformance": "conformance_tests"}

packages: list[str] = []
package_dir: dict[str, str] = {}
for name, root in ROOTS.items():
    found = find_packages(where=root, include=[name, f"{name}.*"])
    packages += found
    package_dir.update({pkg: f"{root}/{pkg.replace('.', '/')}" for pkg in found})

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"engine_plugin_sdk": ["templates/**/*", "templates/*"], "engine_conformance": ["*.py"]},
    include_package_data=True,
)

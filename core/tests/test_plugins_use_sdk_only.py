"""The SDK is the plugins' one door: no plugin package reaches into the core, no vendor plugin into another."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "plugins"
# the pattern the acceptance check greps for, line by line
CORE_IMPORT = re.compile(r"^\s*(from engine(\.|\s)|import engine(\.|\s|$))")
# a plugin's tests may use the public engine API (engine.LLM, engine.SamplingParams, ...), never a module of it
PUBLIC_TEST_IMPORT = re.compile(r"^\s*from engine import ")


def plugin_packages() -> list[pathlib.Path]:
    packages = sorted(PLUGINS.glob("*/engine_plugin_*"))
    assert len(packages) >= 5, f"expected the five shipped plugins under {PLUGINS}, found {packages}"
    return packages


def offending_lines(folder: pathlib.Path, allowed: re.Pattern[str] | None = None) -> list[str]:
    hits = []
    for path in sorted(folder.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if CORE_IMPORT.match(line) and not (allowed and allowed.match(line)):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return hits


def test_plugin_packages_import_only_the_sdk() -> None:
    hits = [hit for package in plugin_packages() for hit in offending_lines(package)]
    assert not hits, "plugin packages import the core's internals (use engine_plugin_sdk):\n" + "\n".join(hits)


def test_plugin_tests_use_the_public_api_and_no_conformance_test_module() -> None:
    hits = []
    for tests in sorted(PLUGINS.glob("*/tests")):
        hits += offending_lines(tests, allowed=PUBLIC_TEST_IMPORT)
        for path in sorted(tests.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine_conformance.test_"):
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {node.module}")
    assert not hits, "plugin tests reach past the public API:\n" + "\n".join(hits)


def test_the_amd_plugin_does_not_depend_on_the_nvidia_plugin() -> None:
    folder = PLUGINS / "amd_rocm"
    hits = [
        f"{path.relative_to(ROOT)}"
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.suffix in {".py", ".toml", ".md"}
        and re.search(r"engine[_-]plugin[_-]nvidia", path.read_text(encoding="utf-8"))
    ]
    assert not hits, f"the AMD plugin names the NVIDIA plugin in {hits}"

"""The core never reaches a vendor library: checked on the source and on what importing it loads."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

CORE = pathlib.Path(__file__).resolve().parents[1] / "engine"
VENDOR_MODULES = {"triton", "jax", "jaxlib", "torch_npu", "pynvml", "amdsmi", "flash_attn", "flashinfer"}
PLUGIN_MODULES = ("engine_plugin_",)


def core_sources():
    return [p for p in CORE.rglob("*.py") if "tests" not in p.relative_to(CORE).parts]


def test_no_vendor_or_plugin_imports_in_core_source():
    offenders = []
    for path in core_sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in VENDOR_MODULES or (top.startswith(PLUGIN_MODULES) and top != "engine_plugin_sdk"):
                    offenders.append(f"{path.relative_to(CORE)}:{node.lineno} imports {name}")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                if node.value.attr in ("cuda", "npu") and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch":
                    offenders.append(f"{path.relative_to(CORE)}:{node.lineno} uses torch.{node.value.attr}.{node.attr}")
    assert not offenders, "\n".join(offenders)


def test_importing_the_core_loads_no_vendor_library():
    code = (
        "import sys, engine, engine.llm_engine, engine.interfaces, engine.plugins;"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(VENDOR_MODULES)!r});"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_import_engine_is_cheap():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, engine; print('torch' in sys.modules)"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"

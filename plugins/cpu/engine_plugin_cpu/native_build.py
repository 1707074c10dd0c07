"""Builds the plugin's C kernels (``csrc/*.c``) with the system C compiler and loads them.

The library is compiled once per source, compiler and flag set, into a cache directory, on first use
rather than at ``pip install`` (a build-isolated install would pull a second torch; the kernels do not
need torch's headers at all, only a C compiler). It is built in and loaded from a folder only when that
folder and the file belong to this user and nobody else can write them (:func:`ownership_problem`). Where the CPU lacks the instructions, no compiler is
found, or ``ENGINE_CPU_NATIVE=0`` is set, :func:`load_native` says why and the plugin keeps its torch
path, so nothing here is required for correctness.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine_plugin_cpu.platform import cpu_flags

logger = logging.getLogger(__name__)

#: set to 0 to keep the torch path (no C kernels)
NATIVE_ENV = "ENGINE_CPU_NATIVE"
#: where compiled libraries are kept; default ``$XDG_CACHE_HOME/engine/cpu_kernels``
CACHE_ENV = "ENGINE_CPU_KERNEL_CACHE"
#: the C compiler to use; default ``cc``
COMPILER_ENV = "CC"
SOURCE_DIR = Path(__file__).with_name("csrc")
#: instructions the kernels use, as /proc/cpuinfo names them
REQUIRED_CPU_FLAGS = frozenset(
    {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c", "fma"}
)
#: instructions the tile kernels (encoder attention) add; compiled per function, run only where present
AMX_CPU_FLAGS = frozenset({"amx_tile", "amx_bf16"})
#: set to 0 to keep torch's kernels where the C kernels would use AMX tiles
AMX_ENV = "ENGINE_CPU_AMX"
COMPILE_FLAGS = (
    "-O3", "-shared", "-fPIC", "-pthread", "-std=gnu11",
    "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mf16c", "-mfma",
)  # fmt: skip
COMPILE_TIMEOUT_S = 120
#: what one compilation takes, as start-up announces it (about 2 s measured on a 2-core Xeon)
EXPECTED_COMPILE_S = 5

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_F32 = ctypes.c_float
#: a quantized product's entry (pool, team, x, records, out, rows, n, k, out_f32, threads), one per code form
_QLINEAR = ([_P, _P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT], _INT)
#: exported function -> (argument types, return type)
# fmt: off
SIGNATURES: dict[str, tuple[list, object]] = {
    "pool_create": ([_INT], _P),
    "pool_destroy": ([_P], None),
    "pool_size": ([_P], _INT),
    "q4_linear": _QLINEAR,
    "q8_linear": _QLINEAR,
    "q6_linear": _QLINEAR,
    "q5_linear": _QLINEAR,
    "q2_linear": _QLINEAR,
    "iq4_linear": _QLINEAR,
    "rms_norm_bf16": ([_P, _P, _P, _I64, _I64, _F32], None),
    "add_rms_norm_f32": ([_P, _P, _INT, _P, _P, _P, _I64, _I64, _F32], None),
    "silu_and_mul_bf16": ([_P, _P, _I64, _I64], None),
    "add_layer_norm_bf16": ([_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _F32, _INT], None),
    "rotary_bf16": ([_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64], _INT),
    "amx_request": ([], _INT),
    "encoder_attention_bf16": (
        [_P, _P, _P, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F32, _INT], _INT
    ),
    "dense_amx_bf16": ([_P, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _INT, _P, _I64, _INT], _INT),
    "paged_decode_bf16": (
        [_P, _P, _P, _P, _P, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64,
         _F32, _F32, _I64, _INT],
        _INT,
    ),
}
# fmt: on


@dataclass(frozen=True, slots=True)
class NativeLoad:
    """The outcome of :func:`load_native`: the library, or the reason there is none."""

    lib: ctypes.CDLL | None
    reason: str


def native_enabled(environ: dict[str, str] | os._Environ | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(NATIVE_ENV, "1")
    return value.strip().lower() not in ("0", "false", "no", "off")


def amx_usable(flags: frozenset[str] | None = None, environ: dict[str, str] | os._Environ | None = None) -> bool:
    """Whether the tile kernels may run: the CPU has AMX-BF16 and ``ENGINE_CPU_AMX`` is not 0 (the OS
    must still grant the tile state, which :class:`NativeKernels` asks for)."""
    value = (os.environ if environ is None else environ).get(AMX_ENV, "1")
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    return AMX_CPU_FLAGS <= (cpu_flags() if flags is None else flags)


def cache_dir(environ: dict[str, str] | os._Environ | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "engine" / "cpu_kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get(COMPILER_ENV, "cc")) or shutil.which("gcc")


def native_prerequisites(flags: frozenset[str] | None = None) -> str:
    """Why the kernels cannot be built here (empty when they can): turned off, CPU flags, compiler."""
    if not native_enabled():
        return f"{NATIVE_ENV}=0"
    missing = REQUIRED_CPU_FLAGS - (cpu_flags() if flags is None else flags)
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    if _compiler() is None:
        return "no C compiler (cc / gcc / $CC) on PATH"
    return ""


def load_native(flags: frozenset[str] | None = None) -> NativeLoad:
    """Compile (or reuse) and load the kernels library.

    Args:
        flags: the CPU's feature flags; None reads /proc/cpuinfo.

    Returns:
        The loaded library with its signatures set, or None and a one-line reason.
    """
    reason = native_prerequisites(flags)
    if reason:
        return NativeLoad(None, reason)
    compiler = _compiler()
    assert compiler is not None  # native_prerequisites checked it
    digest = hashlib.sha256("\0".join((compiler, *COMPILE_FLAGS)).encode())
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    key = digest.hexdigest()[:16]
    target, error = _build_or_reuse(compiler, f"cpu_kernels-{key}.so")
    if target is None:
        return NativeLoad(None, error)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return NativeLoad(None, f"cannot load {target}: {exc}")
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return NativeLoad(lib, "")


def kernel_folders(environ: dict[str, str] | os._Environ | None = None) -> list[Path]:
    """Where the library may be built and loaded from, in order: the cache folder, then a folder of this
    user's own in the temporary directory (for a read-only home, or a cache folder others can write)."""
    return [cache_dir(environ), Path(tempfile.gettempdir()) / f"engine-cpu-kernels-{os.getuid()}"]


def ownership_problem(path: Path, folder: bool) -> str:
    """Why loading code from ``path`` is unsafe ('' when it is safe).

    A library is only as trustworthy as whoever can write it: anyone who can replace the file, or
    the folder's entries, can run code in this process. So ``path`` must belong to this user and be
    writable by nobody else.

    Args:
        path: a folder or a library file.
        folder: whether ``path`` must be a folder.

    Returns:
        A one-line reason, or '' when ``path`` is safe.
    """
    try:
        st = path.stat()
    except OSError as exc:
        return f"cannot inspect {path}: {exc.strerror or exc}"
    if folder and not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder"
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def _build_or_reuse(compiler: str, name: str) -> tuple[Path | None, str]:
    """The library built as ``name`` in the first usable folder of :func:`kernel_folders`.

    Returns:
        Its path and '', or None and a one-line reason.
    """
    problems: list[str] = []
    for folder in kernel_folders():
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            problems.append(f"cannot create {folder}: {exc.strerror or exc}")
            continue
        problem = ownership_problem(folder, folder=True)
        if problem:
            logger.warning("not building the CPU kernels in %s: %s", folder, problem)
            problems.append(problem)
            continue
        target = folder / name
        if target.exists() and not ownership_problem(target, folder=False):
            return target, ""
        # missing, or a file someone else could have written: (re)build it, replacing it atomically
        error = _compile(compiler, target)
        if not error:
            return target, ""
        if not error.startswith("cannot create"):
            return None, error
        problems.append(error)  # a read-only folder: try the next one
    return None, "no private folder to build the CPU kernels in: " + "; ".join(problems)


def _compile(compiler: str, target: Path) -> str:
    """Compile to a temporary name and rename, so concurrent processes never load a partial file."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {target.parent}: {exc}"
    try:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    except OSError as exc:
        return f"cannot create a file in {target.parent}: {exc}"
    os.close(fd)
    sources = [str(p) for p in sorted(SOURCE_DIR.glob("*.c"))]
    cmd = [compiler, *COMPILE_FLAGS, *sources, "-o", tmp, "-lm"]
    # said before it starts: the first start would otherwise pause without a word
    logger.info("compiling the CPU kernels (first start only, about %d s)...", EXPECTED_COMPILE_S)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
            return f"compiling the CPU kernels failed: {first}"
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"compiling the CPU kernels failed: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("compiled the CPU kernels in %.1f s into %s", time.perf_counter() - started, target)
    return ""

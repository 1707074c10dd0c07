"""Which variants of each kernel Triton has compiled in this process (a diagnostic: serving should compile
none after start-up, see ``engine.warm_up`` and ``attention_kernels.BATCH_VARYING_ARGS``)."""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Iterator
from types import ModuleType

import triton

import engine_plugin_sdk.gpu.triton_kernels as package


def kernel_modules() -> list[ModuleType]:
    """Every module of this package (the kernels of each family: attention, GEMVs, grouped integers, MoE...)."""
    return [importlib.import_module(f"{package.__name__}.{info.name}") for info in pkgutil.iter_modules(package.__path__)]


def compiled_variant_keys(extra: tuple[ModuleType, ...] = ()) -> dict[str, set[str]]:
    """The specialization keys (argument types, alignments, constexpr values and options) of every compiled
    variant of this package's kernels and of ``extra`` modules' (an A/B's earlier kernel), by kernel name;
    empty in the interpreter, which compiles nothing."""
    keys: dict[str, set[str]] = {}
    for module in [*kernel_modules(), *extra]:
        for name, fn in vars(module).items():
            if isinstance(fn, triton.runtime.JITFunction):
                found = keys.setdefault(name, set())
                for caches in fn.device_caches.values():
                    found.update(str(key) for key in caches[0])
    return keys


def compiled_variants(extra: tuple[ModuleType, ...] = ()) -> dict[str, int]:
    """How many variants of each kernel are compiled (see :func:`compiled_variant_keys`)."""
    return {name: len(keys) for name, keys in compiled_variant_keys(extra).items()}


def new_variants(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Kernels with more variants in ``after`` than in ``before``, and how many more."""
    return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}


def new_variant_keys(before: dict[str, set[str]], after: dict[str, set[str]]) -> dict[str, list[str]]:
    """The keys of variants in ``after`` that ``before`` lacks, by kernel name: what compiled in between."""
    return {name: sorted(keys - before.get(name, set())) for name, keys in after.items() if keys - before.get(name, set())}


@contextlib.contextmanager
def watch_compiles(extra: tuple[ModuleType, ...] = ()) -> Iterator[dict[str, list[str]]]:
    """Within the block, note the kernel variants compiled (a benchmark's timed run should compile none): the
    yielded dict is filled on exit, as :func:`new_variant_keys` gives them."""
    found: dict[str, list[str]] = {}
    before = compiled_variant_keys(extra)
    try:
        yield found
    finally:
        found.update(new_variant_keys(before, compiled_variant_keys(extra)))

"""Which variants of each kernel Triton has compiled in this process (a diagnostic: serving should compile
none after start-up, see ``engine.warm_up`` and ``attention_kernels.BATCH_VARYING_ARGS``)."""

from __future__ import annotations

from types import ModuleType

import triton

from engine_plugin_sdk.gpu.triton_kernels import (
    attention_kernels,
    decode_attention_kernels,
    decode_merge_kernels,
    elementwise_kernels,
    gemv_kernels,
)

_MODULES = (attention_kernels, decode_attention_kernels, decode_merge_kernels, elementwise_kernels, gemv_kernels)


def compiled_variant_keys(extra: tuple[ModuleType, ...] = ()) -> dict[str, set[str]]:
    """The specialization keys (argument types, alignments, constexpr values and options) of every compiled
    variant of this package's kernels and of ``extra`` modules' (an A/B's earlier kernel), by kernel name;
    empty in the interpreter, which compiles nothing."""
    keys: dict[str, set[str]] = {}
    for module in _MODULES + extra:
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

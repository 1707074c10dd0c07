"""How many variants of each kernel Triton has compiled in this process (a diagnostic: serving should
compile none after start-up, see ``engine.warm_up`` and ``attention_kernels.BATCH_VARYING_ARGS``)."""

from __future__ import annotations

import triton

from engine_plugin_sdk.gpu.triton_kernels import (
    attention_kernels,
    decode_attention_kernels,
    decode_merge_kernels,
    elementwise_kernels,
    gemv_kernels,
)


def compiled_variants() -> dict[str, int]:
    """Compiled variants of every kernel of this package, by kernel name (empty in the interpreter, which compiles nothing)."""
    counts = {}
    for module in (attention_kernels, decode_attention_kernels, decode_merge_kernels, elementwise_kernels, gemv_kernels):
        for name, fn in vars(module).items():
            if isinstance(fn, triton.runtime.JITFunction):
                counts[name] = sum(len(caches[0]) for caches in fn.device_caches.values())
    return counts


def new_variants(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Kernels with more variants in ``after`` than in ``before``, and how many more."""
    return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}

"""A platform built from the reference backends: the base a scaffolded plugin starts from."""

from __future__ import annotations

import os

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine.interfaces.gemm import GemmBackend
from engine.interfaces.platform import Capabilities, DetectResult, Platform

MEMINFO_PATH = "/proc/meminfo"


def host_memory_bytes(field: str) -> int | None:
    """A ``/proc/meminfo`` field (``"MemTotal"``, ``"MemAvailable"``) in bytes, or None where there is none."""
    try:
        with open(MEMINFO_PATH, encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key == field:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class ReferencePlatform(Platform):
    """Every interface through :mod:`engine_plugin_sdk.reference_backends`, on ``torch_device_type``.

    Subclasses set ``name`` and usually override :meth:`detect` and, as they bring their own kernels,
    the ``make_*`` factories and :meth:`capabilities`.
    """

    priority = -100

    @classmethod
    def detect(cls) -> DetectResult:
        return DetectResult(True)

    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=("float32", "bfloat16"),
            kv_cache_dtypes=("float32", "bfloat16"),
            block_sizes=(8, 16, 32),
            head_sizes=(64, 80, 128, 256),
            quant_schemes=(),
            graph_capture=False,
            sliding_window=True,
            logits_soft_cap=True,
            attention_sinks=True,
            non_causal_attention=True,
            non_causal_sliding_window=True,
            swap=True,
            lora=True,
        )

    def total_memory_bytes(self) -> int:
        total = host_memory_bytes("MemTotal")
        return total if total is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def free_memory_bytes(self) -> int:
        free = host_memory_bytes("MemAvailable")
        return free if free is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def make_attention_backend(self) -> AttentionBackend:
        from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend

        return ReferenceAttentionBackend()

    def make_gemm_backend(self) -> GemmBackend:
        from engine_plugin_sdk.reference_backends import ReferenceGemmBackend

        return ReferenceGemmBackend()

    def make_block_cache(self, spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend) -> BlockCache:
        from engine_plugin_sdk.torch_block_cache import TorchBlockCache

        return TorchBlockCache(spec, num_blocks, attention, device=self.torch_device_type)


class ReferenceDevicePlatform(ReferencePlatform):
    """The reference platform as a device of its own (see :mod:`engine_plugin_sdk.reference_plugin`)."""

    name = "reference"

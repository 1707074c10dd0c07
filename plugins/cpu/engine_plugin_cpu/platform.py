"""The CPU platform: always available, lowest priority, memory from /proc/meminfo."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine.interfaces.gemm import GemmBackend
from engine.interfaces.platform import Capabilities, DetectResult, Platform

if TYPE_CHECKING:
    from engine.config import EngineConfig

MEMINFO_PATH = "/proc/meminfo"
CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"
CGROUP_MEMORY_CURRENT = "/sys/fs/cgroup/memory.current"

#: the dtype ``--dtype auto`` resolves to here: fp32 is exact and the CPU GEMMs are fast in it
PREFERRED_DTYPE = "float32"
SUPPORTED_DTYPES = ("float32", "bfloat16")
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64)
#: the KV budget when the user sets none: host RAM is shared with everything else on the machine
DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
# torch's CPU SDPA and the fallback matmul path have no head-size limits; these are the tested ones
SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 256)


class CpuPlatform(Platform):
    """Runs everything on the host CPU with torch."""

    name = "cpu"
    aliases = ("host",)
    priority = 0
    torch_device_type = "cpu"

    @classmethod
    def detect(cls) -> DetectResult:
        # a process that runs Python has a CPU; nothing to initialise
        return DetectResult(True)

    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=SUPPORTED_DTYPES,
            kv_cache_dtypes=SUPPORTED_DTYPES,
            block_sizes=SUPPORTED_BLOCK_SIZES,
            head_sizes=SUPPORTED_HEAD_SIZES,
            quant_schemes=(),
            graph_capture=False,
            sliding_window=True,
            logits_soft_cap=True,
            swap=True,
            extra={"preferred_dtype": PREFERRED_DTYPE},
        )

    def validate(self, config: EngineConfig) -> list[str]:
        if config.dtype == "auto":
            # "auto" means "the platform's choice"; judge the dtype we would actually pick
            config = config.model_copy(update={"dtype": PREFERRED_DTYPE})
        return super().validate(config)

    def total_memory_bytes(self) -> int:
        total = read_meminfo_bytes("MemTotal")
        if total is None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        limit = read_cgroup_limit()
        return min(total, limit) if limit is not None else total

    def free_memory_bytes(self) -> int:
        free = read_meminfo_bytes("MemAvailable")
        if free is None:
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        limit = read_cgroup_limit()
        if limit is not None:
            used = read_int_file(CGROUP_MEMORY_CURRENT) or 0
            free = min(free, max(0, limit - used))
        return free

    def default_kv_cache_bytes(self) -> int | None:
        # a fixed size, but never more than a quarter of what is free: the swap pool and the model's
        # own weights and activations live in the same RAM
        return min(DEFAULT_KV_CACHE_BYTES, self.free_memory_bytes() // 4)

    def make_attention_backend(self) -> AttentionBackend:
        from engine_plugin_cpu.attention import CpuAttentionBackend

        return CpuAttentionBackend()

    def make_gemm_backend(self) -> GemmBackend:
        from engine_plugin_cpu.gemm import CpuGemmBackend

        return CpuGemmBackend()

    def make_block_cache(self, spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend) -> BlockCache:
        from engine_plugin_cpu.block_cache import CpuBlockCache

        return CpuBlockCache(spec, num_blocks, attention)


def read_meminfo_bytes(field: str, path: str = MEMINFO_PATH) -> int | None:
    """A ``/proc/meminfo`` field in bytes, or None if the file or field is missing."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key == field:
                    parts = rest.split()
                    scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
                    return int(parts[0]) * scale
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_int_file(path: str) -> int | None:
    """An integer from a one-value file (cgroup style), or None if absent or not a number."""
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def read_cgroup_limit() -> int | None:
    """The cgroup v2 memory limit in bytes, or None when there is none ("max") or no cgroup v2."""
    return read_int_file(CGROUP_MEMORY_MAX)


def torch_dtype(dtype: Any) -> Any:
    """Map a dtype name (``"float32"``, ``"bfloat16"``) or a torch dtype to a torch dtype.

    Raises:
        ValueError: for a name torch does not know or a dtype this platform does not run.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; the CPU platform runs {list(SUPPORTED_DTYPES)}")
    return resolved

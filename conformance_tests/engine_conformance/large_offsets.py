"""Caches with more than 2**31 elements whose used blocks sit at the top: a classic int32 offset overflow.

The memory such a check needs is what it touches, not the cache's size:

- a cache in host memory (the CPU, Triton's interpreter, a JAX plugin on CPU tensors) is a sparse file
  mapped shared: blocks nobody touches are holes, read as zeros and never allocated, and pages a backend
  does write can be written back to disk under memory pressure instead of exhausting RAM. So the check
  needs a few MiB of RAM for the used blocks, whatever the cache's virtual size;
- a device cache is allocated whole (device allocators are not lazy), so the device must hold it.

Where the host lacks even the touched bytes, or the device the whole cache, the check says "not runnable
here" with the numbers: never a pass without running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import torch_dtype
from engine_conformance.pytest_plugin import not_runnable

#: blocks used at the top of the pool
TOP_BLOCKS = 64
#: what a check may hold besides the used blocks (problem tensors, gathered copies, kernel scratch)
HOST_SLACK_BYTES = 512 * 2**20
KV_HEADS = 1


@dataclass(frozen=True, slots=True)
class LargeCache:
    """The geometry of a cache whose top blocks start beyond 2**31 elements.

    Attributes:
        shape: one layer's cache shape in the backend's layout.
        dtype: the narrowest claimed dtype (the smallest cache for the element count).
        num_blocks: blocks in the pool; the top :data:`TOP_BLOCKS` are the used ones.
        block_size, head_dim: the largest claimed block and the smallest claimed head.
        total_bytes: the whole cache.
        touched_bytes: the used blocks.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    head_dim: int
    total_bytes: int
    touched_bytes: int

    @property
    def top_blocks(self) -> list[int]:
        return list(range(self.num_blocks - TOP_BLOCKS, self.num_blocks))


def plan(backend: AttentionBackend, caps: Capabilities) -> LargeCache:
    """Size a cache so that even with keys and values in two halves of it (``[2, blocks, ...]``), the
    first used block's keys start past element 2**31."""
    dtype = min((torch_dtype(d) for d in caps.dtypes), key=lambda d: torch.empty((), dtype=d).element_size())
    head_dim, block_size = min(caps.head_sizes), max(caps.block_sizes)
    per_block = math.prod(backend.kv_cache_shape(2, block_size, KV_HEADS, head_dim)) - math.prod(
        backend.kv_cache_shape(1, block_size, KV_HEADS, head_dim)
    )
    num_blocks = 2 * (2**31 // per_block) + TOP_BLOCKS + 2
    shape = tuple(backend.kv_cache_shape(num_blocks, block_size, KV_HEADS, head_dim))
    size = torch.empty((), dtype=dtype).element_size()
    return LargeCache(
        shape, dtype, num_blocks, block_size, head_dim, math.prod(shape) * size, TOP_BLOCKS * per_block * size
    )


def allocate(platform: Platform, cache: LargeCache, folder: Path) -> torch.Tensor:
    """The cache, sparse in host memory or whole on the device; skips as not runnable where it cannot fit."""
    device = torch.device(platform.torch_device())
    free = platform.free_memory_bytes()
    if device.type != "cpu":
        if free < 1.1 * cache.total_bytes:
            not_runnable(
                f"a cache with more than 2**31 elements takes {cache.total_bytes / 2**30:.1f} GiB on "
                f"{platform.name} (device memory is allocated whole); {free / 2**30:.1f} GiB free"
            )
        return torch.empty(cache.shape, dtype=cache.dtype, device=device)
    need = cache.touched_bytes + HOST_SLACK_BYTES
    if free < need:
        not_runnable(
            f"the used blocks of the >2**31-element cache and the check's tensors need "
            f"{need / 2**20:.0f} MiB of host memory; {free / 2**20:.0f} MiB available"
        )
    path = folder / "large_kv_cache.bin"
    numel = math.prod(cache.shape)
    try:
        # a sparse file: holes cost neither RAM nor disk until written
        with open(path, "wb") as fh:
            fh.truncate(numel * torch.empty((), dtype=cache.dtype).element_size())
        mapped = torch.from_file(str(path), shared=True, size=numel, dtype=cache.dtype)
        # the mapping outlives the name: the blocks written go away with the tensor, not with the tmp dir
        path.unlink()
    except (OSError, RuntimeError) as exc:
        not_runnable(f"cannot map a sparse {cache.total_bytes / 2**30:.1f} GiB cache file in {folder}: {exc}")
    return mapped.view(cache.shape)


def host_peak_reset() -> bool:
    """Reset this process's peak resident size (Linux ``clear_refs``); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def host_peak_bytes() -> int | None:
    """This process's peak resident size since the last reset (``VmHWM``), or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None

"""The KV block pool in GPU memory (HIP device memory under ROCm), with a host pool for swapping.

The SDK's reference block cache already does per-layer index copies on the block axis, which is all
that copy-on-write and swapping need here; this module only fixes the dtype and device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine_plugin_amd.gemm import to_torch_dtype
from engine_plugin_sdk.reference_backends import ReferenceBlockCache


def make_rocm_block_cache(spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend, device: Any) -> BlockCache:
    """A block cache on ``device`` with swapping to host memory.

    Args:
        spec: cache geometry; ``spec.dtype`` a torch dtype or a dtype name.
        num_blocks: device blocks.
        attention: fixes the layer layout (block axis at 1).
        device: torch device of the pool.

    Raises:
        ValueError: for an unsupported dtype or a non-positive block count.
    """
    spec = dataclasses.replace(spec, dtype=to_torch_dtype(spec.dtype))
    # a quarter of the device blocks on the host: swapping is the rare fallback to recompute
    return ReferenceBlockCache(spec, num_blocks, attention, torch.device(device), num_host_blocks=max(1, num_blocks // 4))

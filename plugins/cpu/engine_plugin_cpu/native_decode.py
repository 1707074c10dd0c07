"""When a layer's attention may run in the C decode kernel (``NativeKernels.paged_decode``).

The kernel indexes the cache with the step's block tables and slots without bounds checks, so a step
is validated once, on its first layer (the result is cached in the metadata's extras); the per-layer
checks are layout only.
"""

from __future__ import annotations

from typing import Any

import torch

from engine_plugin_cpu.attention_checks import check_shapes, check_slots
from engine_plugin_sdk import AttentionMetadata

#: where a step's check is cached: None (not eligible) or its total context length
NATIVE_DECODE_KEY = "cpu_native_decode"


def native_decode_context(
    query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata
) -> int | None:
    """The step's total context if the C decode kernel can run this layer, else None.

    The metadata is validated on the step's first layer only (the kernel indexes the cache without
    bounds checks); the layout checks are per call and cheap.
    """
    head_dim = query.shape[2]
    if query.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16 or head_dim % 32:
        return None
    for t in (query, key, value):
        if t.stride()[1:] != (head_dim, 1):
            return None
    if not kv_cache.is_contiguous():
        return None
    if NATIVE_DECODE_KEY not in metadata.extras:
        metadata.extras[NATIVE_DECODE_KEY] = check_native_step(query, key, value, kv_cache, metadata)
    return metadata.extras[NATIVE_DECODE_KEY]


def check_native_step(
    query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata
) -> int | None:
    if query.shape[0] != metadata.num_seqs:
        return None
    tables, lens, slots = metadata.block_tables, metadata.seq_lens, metadata.slot_mapping
    if tables.dtype != torch.int32 or lens.dtype != torch.int32 or slots.dtype != torch.int64:
        return None
    if not (tables.is_contiguous() and lens.is_contiguous() and slots.is_contiguous()):
        return None
    check_shapes(query, key, value, kv_cache, metadata.block_size)
    if slots.numel() != query.shape[0]:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {query.shape[0]} tokens")
    check_slots(int(slots.max()) if slots.numel() else -1, kv_cache)
    num_blocks = kv_cache.shape[1]
    if tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < num_blocks:
        raise ValueError(f"block table entries outside the cache's {num_blocks} blocks")
    width = tables.shape[1] * metadata.block_size
    if any(n < 0 or n > width for n in metadata.seq_lens_cpu):
        raise ValueError(f"a context length exceeds its block table ({width} tokens)")
    return sum(metadata.seq_lens_cpu)

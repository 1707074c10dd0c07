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
    if not kernel_reads_layout(query, key, value, kv_cache):
        return None
    if NATIVE_DECODE_KEY not in metadata.extras:
        metadata.extras[NATIVE_DECODE_KEY] = check_native_step(query, key, value, kv_cache, metadata)
    return metadata.extras[NATIVE_DECODE_KEY]


def kernel_reads_layout(query: Any, key: Any, value: Any, kv_cache: Any) -> bool:
    """Whether the C kernel reads these tensors as they are: bf16, each token's heads contiguous, head
    size a multiple of 32, a contiguous cache (checked per layer: cheap)."""
    head_dim = query.shape[2]
    if query.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16 or head_dim % 32:
        return False
    return all(t.stride()[1:] == (head_dim, 1) for t in (query, key, value)) and kv_cache.is_contiguous()


def _check_tokens_and_slots(query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> None:
    """Raise ValueError for shapes that do not fit or a slot outside the cache (the kernel writes there)."""
    check_shapes(query, key, value, kv_cache, metadata.block_size)
    slots = metadata.slot_mapping
    if slots.numel() != query.shape[0]:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {query.shape[0]} tokens")
    check_slots(int(slots.max()) if slots.numel() else -1, kv_cache)


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
    _check_tokens_and_slots(query, key, value, kv_cache, metadata)
    num_blocks = kv_cache.shape[1]
    if tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < num_blocks:
        raise ValueError(f"block table entries outside the cache's {num_blocks} blocks")
    width = tables.shape[1] * metadata.block_size
    if any(n < 0 or n > width for n in metadata.seq_lens_cpu):
        raise ValueError(f"a context length exceeds its block table ({width} tokens)")
    return sum(metadata.seq_lens_cpu)


#: a step whose rows all bring at most this many new tokens (speculative verification's k + 1, a prompt's
#: last short chunk) may run in the decode kernel, one kernel row per token
SHORT_QUERY_MAX = 16
#: where such a step's per-token tables are cached: None (not eligible) or (tables, lengths, total context)
NATIVE_SHORT_ROWS_KEY = "cpu_native_short_rows"


def native_short_rows(
    query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Each new token of a causal step of short rows as a decode row of its own: its sequence's block table
    and a context ending at the token itself (the C kernel stores every token's key and value before any
    row attends, so a row sees the tokens before it in its sequence). Returns the per-token block tables,
    context lengths and total context, or None when the step or the layer's layout does not qualify.

    A verification step then runs each token's attention exactly as a decode step would have: 5 rows of a
    k = 4 verification cost 1 gather-free kernel call per layer instead of the prefill path's gather and
    SDPA, about four times a decode step's attention on the embedded model.
    """
    if not kernel_reads_layout(query, key, value, kv_cache):
        return None
    if NATIVE_SHORT_ROWS_KEY not in metadata.extras:
        metadata.extras[NATIVE_SHORT_ROWS_KEY] = _short_rows(query, key, value, kv_cache, metadata)
    return metadata.extras[NATIVE_SHORT_ROWS_KEY]


def _short_rows(
    query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    q_lens, ctx = metadata.query_lens_cpu, metadata.seq_lens_cpu
    if not metadata.causal or not q_lens or max(q_lens) > SHORT_QUERY_MAX or sum(q_lens) != query.shape[0]:
        return None
    tables, slots = metadata.block_tables, metadata.slot_mapping
    if tables.dtype != torch.int32 or slots.dtype != torch.int64 or not slots.is_contiguous():
        return None
    _check_tokens_and_slots(query, key, value, kv_cache, metadata)
    # entries the kernel cannot index unchecked (a window's released blocks): the prefill path decides
    num_blocks = kv_cache.shape[1]
    if tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < num_blocks:
        return None
    width = tables.shape[1] * metadata.block_size
    if any(n < q or n > width for q, n in zip(q_lens, ctx, strict=True)):
        return None
    lengths = [n - q + 1 + j for q, n in zip(q_lens, ctx, strict=True) for j in range(q)]
    per_token = torch.tensor(q_lens, dtype=torch.int64)
    token_tables = tables.repeat_interleave(per_token, dim=0).contiguous()
    return token_tables, torch.tensor(lengths, dtype=torch.int32), sum(lengths)

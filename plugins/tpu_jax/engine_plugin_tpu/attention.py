"""The AttentionBackend interface over the JAX kernels, for JAX arrays and (at the boundary) torch tensors.

JAX arrays are immutable, so :meth:`JaxAttentionBackend.write_kv` returns the updated cache (the
interface allows that). A caller that hands in a torch tensor (the conformance suite, any torch code)
gets torch semantics instead: the call copies only the blocks it touches into a compact JAX cache,
runs the JAX kernels there, and writes those blocks back into the tensor in place. The engine itself
never takes this path: it runs the whole forward in :mod:`engine_plugin_tpu.runner`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from engine_plugin_sdk import AttentionBackend, AttentionMetadata
from engine_plugin_tpu.arrays import host_int_array, to_jax, to_torch
from engine_plugin_tpu.paged_attention import (
    TokenBatch,
    chunk_blocks,
    padded_head_dim,
    paged_attention,
    token_batch_from_seqs,
    write_kv,
)
from engine_plugin_tpu.pallas_attention import paged_attention_pallas

SUPPORTED_BLOCK_SIZES = (16, 32, 64)
SUPPORTED_HEAD_SIZES = (64, 128, 256)
ATTENTION_IMPLS = ("jnp", "pallas")


def attend(
    query: jax.Array,
    cache: jax.Array,
    batch: TokenBatch,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    impl: str,
    interpret: bool,
    layer: Any = None,
) -> jax.Array:
    """Dispatch to the jax.numpy or the Pallas kernel (same contract)."""
    if impl == "pallas":
        return paged_attention_pallas(
            query, cache, batch, scale, causal, sliding_window, soft_cap, interpret, layer
        )
    return paged_attention(query, cache, batch, scale, causal, sliding_window, soft_cap, layer)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "sliding_window", "soft_cap", "impl", "interpret"))
def _write_and_attend(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    cache: jax.Array,
    slots: jax.Array,
    batch: TokenBatch,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    impl: str,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    cache = write_kv(cache, key, value, slots)
    dim = cache.shape[-1]
    head_dim = query.shape[-1]
    if head_dim < dim:
        query = jnp.pad(query, ((0, 0), (0, 0), (0, dim - head_dim)))
    out = attend(query, cache, batch, scale, causal, sliding_window, soft_cap, impl, interpret)
    return out[..., :head_dim], cache


_write_jit = jax.jit(write_kv)


class JaxAttentionBackend(AttentionBackend):
    """Paged attention for any mix of prefill, chunked-prefill and decode tokens, in JAX.

    Args:
        head_dim_multiple: pad the cache's head dimension to a multiple of this (128 on TPU: the lane
            width the kernels want; 1, no padding, on the CPU backend).
        impl: ``"jnp"`` (jax.numpy, any backend) or ``"pallas"`` (the Pallas kernel).
        interpret: run the Pallas kernel in interpret mode (required off-TPU).

    Raises:
        ValueError: for an unknown ``impl``.
    """

    supported_block_sizes = SUPPORTED_BLOCK_SIZES
    supported_head_sizes = SUPPORTED_HEAD_SIZES

    def __init__(self, head_dim_multiple: int = 1, impl: str = "jnp", interpret: bool = True) -> None:
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention impl {impl!r}; choose one of {list(ATTENTION_IMPLS)}")
        self.head_dim_multiple = head_dim_multiple
        self.impl = impl
        self.interpret = interpret
        # a padded cache does not say its logical head size; gather_kv needs it to strip the padding
        self._logical_head_dim: dict[int, int] = {}

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        padded = padded_head_dim(head_dim, self.head_dim_multiple)
        self._logical_head_dim[padded] = head_dim
        return (2, num_kv_heads, num_blocks, block_size, padded)

    def write_kv(self, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> Any:
        slots = host_int_array(slot_mapping, np.int64).reshape(-1)
        if slots.shape[0] != key.shape[0]:
            raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {key.shape[0]} tokens")
        if not isinstance(kv_cache, torch.Tensor):
            return _write_jit(kv_cache, to_jax(key), to_jax(value), jnp.asarray(slots, jnp.int32))
        block_size = kv_cache.shape[3]
        view = _CompactView(kv_cache, np.unique(slots[slots >= 0] // block_size))
        new = _write_jit(view.compact, to_jax(key), to_jax(value), jnp.asarray(view.remap_slots(slots), jnp.int32))
        view.write_back(new)
        return kv_cache

    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        if metadata.sinks is not None:
            raise NotImplementedError("the TPU plugin's attention has no attention sinks (attention_sinks is not claimed)")
        if not metadata.causal and metadata.sliding_window is not None:
            raise ValueError("the TPU plugin's attention has no symmetric non-causal window (non_causal_sliding_window is not claimed)")
        _check(query, key, kv_cache, metadata)
        tables = host_int_array(metadata.block_tables)
        slots = host_int_array(metadata.slot_mapping, np.int64).reshape(-1)
        view = None
        cache = kv_cache
        if isinstance(kv_cache, torch.Tensor):
            used = np.concatenate([tables.reshape(-1), slots[slots >= 0] // metadata.block_size])
            view = _CompactView(kv_cache, np.unique(used))
            tables, slots = view.remap_tables(tables), view.remap_slots(slots)
            cache = view.compact
        per_chunk = chunk_blocks(metadata.block_size)
        width = -(-tables.shape[1] // per_chunk) * per_chunk
        batch = token_batch_from_seqs(
            host_int_array(metadata.query_start_loc), host_int_array(metadata.seq_lens), tables, width
        )
        out, new_cache = _write_and_attend(
            to_jax(query),
            to_jax(key),
            to_jax(value),
            cache,
            jnp.asarray(slots, jnp.int32),
            TokenBatch(*(jnp.asarray(a) for a in (batch.tables, batch.positions, batch.context_lens))),
            scale=float(metadata.scale),
            causal=bool(metadata.causal),
            sliding_window=metadata.sliding_window,
            soft_cap=metadata.logits_soft_cap,
            impl=self.impl,
            interpret=self.interpret,
        )
        if view is not None:
            view.write_back(new_cache)
            return to_torch(out)
        # A JAX cache cannot change in place through this signature: the output is right, but the new
        # keys are kept only by write_kv's returned cache. The engine's runner threads caches itself.
        return out

    def gather_kv(self, kv_cache: Any, block_ids: list[int]) -> tuple[Any, Any]:
        """Keys and values of some blocks as host torch tensors ``[n * block_size, kv_heads, head_dim]``."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if isinstance(kv_cache, torch.Tensor):
            picked = kv_cache.index_select(2, torch.from_numpy(ids))
        else:
            picked = to_torch(jax.device_get(kv_cache[:, :, jnp.asarray(ids, jnp.int32)]))
        _, heads, n, block_size, padded = picked.shape
        head_dim = self._logical_head_dim.get(padded, padded)
        kv = picked[..., :head_dim].permute(0, 2, 3, 1, 4).reshape(2, n * block_size, heads, head_dim)
        return kv[0], kv[1]


class _CompactView:
    """The blocks of a torch cache that one call touches, as a small JAX cache, with id remapping."""

    def __init__(self, cache: torch.Tensor, block_ids: np.ndarray) -> None:
        self.cache = cache
        self.block_ids = block_ids.astype(np.int64)
        self.block_size = cache.shape[3]
        self.index = torch.from_numpy(self.block_ids)
        self.compact = to_jax(cache.index_select(2, self.index).contiguous())

    def remap_tables(self, tables: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.block_ids, tables).astype(np.int32)

    def remap_slots(self, slots: np.ndarray) -> np.ndarray:
        blocks = np.searchsorted(self.block_ids, np.maximum(slots, 0) // self.block_size)
        return np.where(slots >= 0, blocks * self.block_size + slots % self.block_size, -1)

    def write_back(self, compact: jax.Array) -> None:
        self.cache.index_copy_(2, self.index, to_torch(compact).to(self.cache.dtype))


def _check(query: Any, key: Any, kv_cache: Any, metadata: AttentionMetadata) -> None:
    if len(query.shape) != 3 or len(key.shape) != 3:
        raise ValueError(f"query and key must be [tokens, heads, head_dim], got {tuple(query.shape)} and {tuple(key.shape)}")
    if len(kv_cache.shape) != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, kv_heads, blocks, block_size, head_dim], got {tuple(kv_cache.shape)}")
    if kv_cache.shape[3] != metadata.block_size:
        raise ValueError(f"metadata.block_size {metadata.block_size} differs from the cache's {kv_cache.shape[3]}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} kv heads")
    if kv_cache.shape[1] != key.shape[1]:
        raise ValueError(f"the cache has {kv_cache.shape[1]} kv heads, the keys {key.shape[1]}")

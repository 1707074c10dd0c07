"""Paged attention and KV writes as pure JAX functions (jax.numpy; jit- and donation-friendly).

Cache layout per layer: ``[2, num_kv_heads, num_blocks, block_size, head_dim_padded]`` (keys at 0,
values at 1). Heads lead so that one kv head's blocks are contiguous, which is what a TPU kernel DMAs;
the head dimension may be padded (to 128 on TPU, the lane width) with zeros, which leaves dot products
and the attention output unchanged.

The batch is described per *token* rather than per sequence: each new token carries its sequence's
block-table row, its position and its sequence's context length. A mixed prefill/decode batch then
needs no per-sequence shapes at all, so a jitted step compiles once per (tokens, table width) bucket.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

#: key positions attended per inner step of the online softmax (bounds the gathered keys' memory)
KEYS_PER_CHUNK = 256


class TokenBatch(NamedTuple):
    """The per-token view of a flat batch (host arrays, or device arrays inside a jitted step).

    A NamedTuple so that it is a JAX pytree: it passes through ``jax.jit`` as three arrays.

    Attributes:
        tables: int32 ``[num_tokens, table_width]``, each token's sequence block-table row (0-padded).
        positions: int32 ``[num_tokens]``, each token's position in its sequence.
        context_lens: int32 ``[num_tokens]``, its sequence's context length (new tokens included).
    """

    tables: Any
    positions: Any
    context_lens: Any


def padded_head_dim(head_dim: int, multiple: int) -> int:
    """``head_dim`` rounded up to a multiple of ``multiple`` (1 means no padding)."""
    return -(-head_dim // multiple) * multiple


def chunk_blocks(block_size: int) -> int:
    """Blocks per online-softmax chunk; table widths are padded to a multiple of it."""
    return max(1, KEYS_PER_CHUNK // block_size)


def token_batch_from_seqs(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, width: int | None = None
) -> TokenBatch:
    """Expand a per-sequence batch description into the per-token one (host numpy).

    Args:
        query_start_loc: ``[num_seqs + 1]`` cumulative new-token counts.
        seq_lens: ``[num_seqs]`` context lengths.
        block_tables: ``[num_seqs, max_blocks]``.
        width: table width to pad to (at least ``max_blocks``); default: unchanged.
    """
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int32)
    tables = np.asarray(block_tables, dtype=np.int32)
    query_lens = np.diff(qsl)
    seq_of_token = np.repeat(np.arange(len(seq_lens)), query_lens)
    within = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], query_lens)
    positions = (seq_lens[seq_of_token] - query_lens[seq_of_token] + within).astype(np.int32)
    if width is not None and width > tables.shape[1]:
        tables = np.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    return TokenBatch(tables[seq_of_token], positions, seq_lens[seq_of_token])


def write_kv(
    cache: jax.Array, key: jax.Array, value: jax.Array, slots: jax.Array, layer: Any = None
) -> jax.Array:
    """The cache with ``key``/``value`` stored at ``slots`` (functional; donate ``cache`` to update in place).

    Args:
        cache: one layer ``[2, kv_heads, num_blocks, block_size, padded_dim]``, or every layer
            ``[layers, 2, ...]`` with ``layer`` naming the one to write.
        key: ``[num_tokens, kv_heads, head_dim]`` with ``head_dim <= padded_dim``.
        value: like ``key``.
        slots: int ``[num_tokens]``; negative slots (padding) are dropped.
        layer: index into a stacked cache (may be traced), or None for a single layer.
    """
    if layer is None:
        return write_kv(cache[None], key, value, slots, 0)[0]
    _, _, heads, num_blocks, block_size, dim = cache.shape
    total = num_blocks * block_size
    kv = jnp.stack([key, value], axis=1).astype(cache.dtype)  # [T, 2, H, D]
    if kv.shape[-1] < dim:
        kv = jnp.pad(kv, ((0, 0), (0, 0), (0, 0), (0, dim - kv.shape[-1])))
    # JAX wraps negative indices; send padding out of range and let mode="drop" discard it
    slots = jnp.where(slots < 0, total, slots).astype(jnp.int32)
    flat = cache.reshape(-1, 2, heads, total, dim)
    # advanced indices split by slices put the token axis first: the update is [T, 2, H, D]
    flat = flat.at[layer, :, :, slots].set(kv, mode="drop")
    return flat.reshape(cache.shape)


def paged_attention(
    query: jax.Array,
    cache: jax.Array,
    batch: TokenBatch,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: Any = None,
) -> jax.Array:
    """Attend every query token over its sequence's cached keys (the new tokens already written).

    Args:
        query: ``[num_tokens, num_heads, padded_dim]`` (zero-padded like the cache).
        cache: one layer's cache, or every layer's ``[layers, 2, ...]`` with ``layer`` set.
        batch: the per-token block tables, positions and context lengths; the table width must be a
            multiple of :func:`chunk_blocks`.
        scale: softmax scale.
        causal: a token sees keys at positions up to its own.
        sliding_window: if set, only the last ``sliding_window`` positions up to the token's own.
        soft_cap: if set, scores become ``cap * tanh(scores / cap)``.
        layer: index into a stacked cache (may be traced); gathering through it directly avoids
            slicing a whole layer out of the pool first.

    Returns:
        ``[num_tokens, num_heads, padded_dim]`` in the query's dtype.
    """
    num_tokens, num_heads, dim = query.shape
    *_, kv_heads, _, block_size, _ = cache.shape
    group = num_heads // kv_heads
    lead = () if layer is None else (layer,)
    per_chunk = chunk_blocks(block_size)
    width = batch.tables.shape[1]
    if width % per_chunk:
        raise ValueError(f"block-table width {width} is not a multiple of the chunk of {per_chunk} blocks")
    chunk_keys = per_chunk * block_size
    precision = jax.lax.Precision.HIGHEST if query.dtype == jnp.float32 else None
    q = query.reshape(num_tokens, kv_heads, group, dim)
    limit = batch.context_lens[:, None]
    pos = batch.positions[:, None]

    def step(c: int, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, denom, acc = carry
        cols = jax.lax.dynamic_slice_in_dim(batch.tables, c * per_chunk, per_chunk, axis=1)  # [T, C]
        # one gather each; the advanced indices come first: [T, C, kv_heads, block_size, dim]
        keys = cache[(*lead, 0, slice(None), cols)]
        values = cache[(*lead, 1, slice(None), cols)]
        keys = keys.transpose(2, 0, 1, 3, 4).reshape(kv_heads, num_tokens, chunk_keys, dim)
        values = values.transpose(2, 0, 1, 3, 4).reshape(kv_heads, num_tokens, chunk_keys, dim)
        scores = jnp.einsum(
            "tkgd,ktnd->tkgn", q, keys.astype(q.dtype), precision=precision, preferred_element_type=jnp.float32
        )
        scores = scores * scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        j = c * chunk_keys + jnp.arange(chunk_keys)[None, :]
        visible = j < limit
        if causal:
            visible &= j <= pos
        if sliding_window is not None:
            visible &= j > pos - sliding_window
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(-1))
        # a row with nothing visible yet keeps m = -inf; exp against a finite stand-in gives zeros, not NaN
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - safe[..., None])
        correction = jnp.exp(jnp.where(jnp.isfinite(m), m, safe) - safe)
        denom = denom * correction + p.sum(-1)
        pv_dtype = values.dtype if values.dtype != jnp.float32 else jnp.float32
        pv = jnp.einsum(
            "tkgn,ktnd->tkgd", p.astype(pv_dtype), values, precision=precision, preferred_element_type=jnp.float32
        )
        return m_new, denom, acc * correction[..., None] + pv

    init = (
        jnp.full((num_tokens, kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, kv_heads, group, dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, width // per_chunk, step, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]
    return out.reshape(num_tokens, num_heads, dim).astype(query.dtype)

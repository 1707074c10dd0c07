"""Paged attention as a Pallas kernel: one program per (query token, kv head), looping over its blocks.

Each program reads its token's block-table row, walks only the blocks its context (and sliding window)
covers, and keeps an online softmax for the ``num_heads / num_kv_heads`` query heads that share the kv
head, so GQA reads every key block once per group rather than once per query head.

Runs on a TPU (compiled by Mosaic) and, with ``interpret=True``, on any JAX backend: that is how it is
tested here. NOT RUN ON TPU HARDWARE YET: this version passes the whole cache as one operand, which is
correct everywhere but on a TPU only fits caches that fit in VMEM; a production TPU kernel keeps the
cache in HBM (``memory_space=ANY``) and DMAs each block in (double-buffered). See the README.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from engine_plugin_tpu.paged_attention import TokenBatch


def _kernel(
    layer_ref: Any,
    tables_ref: Any,
    positions_ref: Any,
    context_ref: Any,
    q_ref: Any,
    cache_ref: Any,
    o_ref: Any,
    *,
    block_size: int,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
) -> None:
    t = pl.program_id(0)
    h = pl.program_id(1)
    layer = layer_ref[0]
    pos = positions_ref[t]
    context = context_ref[t]
    limit = jnp.minimum(context, pos + 1) if causal else context
    first_block = 0
    if sliding_window is not None:
        first_block = jnp.maximum(pos - sliding_window + 1, 0) // block_size
    last_block = (limit + block_size - 1) // block_size
    q = q_ref[0, 0].astype(jnp.float32)  # [group, dim]
    group = q.shape[0]

    def body(b: Any, carry: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        m, denom, acc = carry
        block = tables_ref[t, b]
        keys = cache_ref[layer, 0, h, block].astype(jnp.float32)  # [block_size, dim]
        values = cache_ref[layer, 1, h, block].astype(jnp.float32)
        scores = jax.lax.dot_general(
            q, keys, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST
        ) * scale  # [group, block_size]
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        j = b * block_size + jax.lax.broadcasted_iota(jnp.int32, (group, block_size), 1)
        visible = j < limit
        if sliding_window is not None:
            visible &= j > pos - sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=1))
        p = jnp.exp(scores - m_new[:, None])
        correction = jnp.exp(m - m_new)
        pv = jax.lax.dot_general(p, values, (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST)
        return m_new, denom * correction + p.sum(axis=1), acc * correction[:, None] + pv

    # every real token sees at least its own position, so the first block always has a visible key
    # and m is finite after it: no NaN from exp(-inf - -inf)
    init = (
        jnp.full((group,), -1e30, jnp.float32),
        jnp.zeros((group,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(first_block, last_block, body, init)
    o_ref[0, 0] = (acc / jnp.maximum(denom, 1e-30)[:, None]).astype(o_ref.dtype)


def paged_attention_pallas(
    query: jax.Array,
    cache: jax.Array,
    batch: TokenBatch,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    layer: Any = None,
) -> jax.Array:
    """The same contract as :func:`engine_plugin_tpu.paged_attention.paged_attention`, as a Pallas kernel.

    Args:
        query: ``[num_tokens, num_heads, padded_dim]``.
        cache: ``[2, kv_heads, num_blocks, block_size, padded_dim]``.
        batch: per-token tables (any width), positions and context lengths.
        scale: softmax scale.
        causal: a token sees keys up to its own position.
        sliding_window: attention window, or None.
        soft_cap: logit soft-cap, or None.
        interpret: run Pallas in interpret mode (any backend; how the CPU tests run it).
        layer: index into a stacked ``[layers, 2, ...]`` cache, or None for one layer.

    Returns:
        ``[num_tokens, num_heads, padded_dim]`` in the query's dtype.
    """
    num_tokens, num_heads, dim = query.shape
    if layer is None:
        cache, layer = cache[None], 0
    _, _, kv_heads, _, block_size, _ = cache.shape
    group = num_heads // kv_heads
    q = query.reshape(num_tokens, kv_heads, group, dim)
    kernel = functools.partial(
        _kernel,
        block_size=block_size,
        scale=scale,
        causal=causal,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )

    def whole(shape: tuple[int, ...]) -> pl.BlockSpec:
        return pl.BlockSpec(shape, lambda t, h, n=len(shape): (0,) * n)

    tables = batch.tables.astype(jnp.int32)
    positions = batch.positions.astype(jnp.int32)
    context = batch.context_lens.astype(jnp.int32)
    layer_index = jnp.asarray(layer, jnp.int32).reshape(1)
    out = pl.pallas_call(
        kernel,
        grid=(num_tokens, kv_heads),
        in_specs=[
            whole((1,)),
            whole(tables.shape),
            whole(positions.shape),
            whole(context.shape),
            pl.BlockSpec((1, 1, group, dim), lambda t, h: (t, h, 0, 0)),
            whole(cache.shape),
        ],
        out_specs=pl.BlockSpec((1, 1, group, dim), lambda t, h: (t, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, query.dtype),
        interpret=interpret,
    )(layer_index, tables, positions, context, q, cache)
    return out.reshape(num_tokens, num_heads, dim)

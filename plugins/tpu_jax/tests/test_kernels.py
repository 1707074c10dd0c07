"""The JAX kernels against a float64 numpy reference: paged attention (jax.numpy and Pallas in interpret
mode) for mixed prefill/decode batches, GQA, padded heads, sliding window, soft-cap; KV writes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from engine_plugin_tpu.paged_attention import (
    TokenBatch,
    chunk_blocks,
    padded_head_dim,
    paged_attention,
    token_batch_from_seqs,
    write_kv,
)
from engine_plugin_tpu.pallas_attention import paged_attention_pallas

NUM_BLOCKS = 40
QUERY_LENS = [5, 1, 16, 1, 9]
CONTEXT_LENS = [37, 50, 16, 3, 73]


def make_problem(seed: int, block_size: int, heads: int, kv_heads: int, head_dim: int, padded: int):
    rng = np.random.default_rng(seed)
    cache = rng.standard_normal((2, kv_heads, NUM_BLOCKS, block_size, padded)).astype(np.float32)
    cache[..., head_dim:] = 0.0  # padding columns stay zero, as the block cache keeps them
    perm = rng.permutation(NUM_BLOCKS)
    tables, cursor = [], 0
    for length in CONTEXT_LENS:
        n = -(-length // block_size)
        tables.append(list(perm[cursor : cursor + n]))
        cursor += n
    width = max(map(len, tables))
    table_array = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(QUERY_LENS)]).astype(np.int32)
    per_chunk = chunk_blocks(block_size)
    batch = token_batch_from_seqs(qsl, np.array(CONTEXT_LENS), table_array, -(-width // per_chunk) * per_chunk)
    query = np.zeros((sum(QUERY_LENS), heads, padded), np.float32)
    query[..., :head_dim] = rng.standard_normal((sum(QUERY_LENS), heads, head_dim))
    return cache, batch, query


def reference(cache, batch, query, head_dim, window=None, cap=None):
    """float64 attention of each token over its context, straight from the block tables."""
    c = cache.astype(np.float64)
    tokens, heads, _ = query.shape
    kv_heads, block_size = c.shape[1], c.shape[3]
    out = np.zeros((tokens, heads, head_dim))
    for t in range(tokens):
        pos = int(batch.positions[t])
        keys = np.concatenate([c[0][:, b] for b in batch.tables[t]], axis=1)[:, : pos + 1, :head_dim]
        values = np.concatenate([c[1][:, b] for b in batch.tables[t]], axis=1)[:, : pos + 1, :head_dim]
        start = 0 if window is None else max(0, pos - window + 1)
        for h in range(heads):
            kh = h // (heads // kv_heads)
            s = keys[kh, start:] @ query[t, h, :head_dim].astype(np.float64) * head_dim**-0.5
            if cap is not None:
                s = cap * np.tanh(s / cap)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ values[kh, start:]
    assert block_size > 0
    return out


def as_jax(batch: TokenBatch) -> TokenBatch:
    return TokenBatch(*(jnp.asarray(a) for a in batch))


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "head_dim", "multiple", "window", "cap"),
    [
        (16, 8, 2, 64, 1, None, None),  # GQA, mixed prefill / chunked prefill / decode
        (32, 4, 1, 64, 128, None, None),  # MQA, head padded to the TPU lane width
        (16, 4, 4, 128, 1, 8, None),  # sliding window
        (16, 4, 2, 64, 1, None, 1.5),  # soft-cap
    ],
)
def test_paged_attention_matches_reference(impl, block_size, heads, kv_heads, head_dim, multiple, window, cap):
    padded = padded_head_dim(head_dim, multiple)
    cache, batch, query = make_problem(7, block_size, heads, kv_heads, head_dim, padded)
    kernel = paged_attention_pallas if impl == "pallas" else paged_attention
    kwargs = {"interpret": True} if impl == "pallas" else {}
    out = kernel(
        jnp.asarray(query), jnp.asarray(cache), as_jax(batch), head_dim**-0.5, True, window, cap, **kwargs
    )
    out = np.asarray(out)
    np.testing.assert_allclose(out[..., :head_dim], reference(cache, batch, query, head_dim, window, cap), atol=2e-5)
    assert not np.any(out[..., head_dim:]), "padded head columns must stay zero"


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_stacked_pool_reads_the_named_layer(impl):
    cache, batch, query = make_problem(8, 16, 4, 2, 64, 64)
    other = np.random.default_rng(9).standard_normal(cache.shape).astype(np.float32)
    pool = jnp.asarray(np.stack([other, cache, other]))
    kernel = paged_attention_pallas if impl == "pallas" else paged_attention
    kwargs = {"interpret": True, "layer": 1} if impl == "pallas" else {"layer": 1}
    out = kernel(jnp.asarray(query), pool, as_jax(batch), 64**-0.5, **kwargs)
    np.testing.assert_allclose(np.asarray(out), reference(cache, batch, query, 64), atol=2e-5)


def test_bfloat16_attention_within_tolerance():
    cache, batch, query = make_problem(10, 16, 8, 2, 64, 64)
    out = paged_attention(
        jnp.asarray(query, jnp.bfloat16), jnp.asarray(cache, jnp.bfloat16), as_jax(batch), 64**-0.5
    )
    assert out.dtype == jnp.bfloat16
    rounded_cache = np.asarray(jnp.asarray(cache, jnp.bfloat16).astype(jnp.float32))
    rounded_query = np.asarray(jnp.asarray(query, jnp.bfloat16).astype(jnp.float32))
    expected = reference(rounded_cache, batch, rounded_query, 64)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected, atol=3e-2, rtol=3e-2)


def test_write_kv_by_slot_drops_padding_and_pads_heads():
    rng = np.random.default_rng(11)
    blocks, block_size, kv_heads, head_dim, padded = 6, 4, 2, 8, 16
    layers = rng.standard_normal((3, 2, kv_heads, blocks, block_size, padded)).astype(np.float32)
    slots = np.array([5, -1, 0, 23, -1, 9])
    key = rng.standard_normal((6, kv_heads, head_dim)).astype(np.float32)
    value = rng.standard_normal((6, kv_heads, head_dim)).astype(np.float32)
    got = np.asarray(write_kv(jnp.asarray(layers), jnp.asarray(key), jnp.asarray(value), jnp.asarray(slots), 2))
    expected = layers.copy()
    flat = expected[2].reshape(2, kv_heads, blocks * block_size, padded)
    for row, slot in enumerate(slots):
        if slot >= 0:
            flat[0, :, slot] = np.pad(key[row], ((0, 0), (0, padded - head_dim)))
            flat[1, :, slot] = np.pad(value[row], ((0, 0), (0, padded - head_dim)))
    expected[2] = flat.reshape(expected[2].shape)
    np.testing.assert_array_equal(got, expected)
    single = write_kv(jnp.asarray(layers[0]), jnp.asarray(key), jnp.asarray(value), jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(single), np.asarray(write_kv(jnp.asarray(layers), jnp.asarray(key), jnp.asarray(value), jnp.asarray(slots), 0))[0])


def test_token_batch_positions_follow_the_sequences():
    batch = token_batch_from_seqs(np.array([0, 3, 4]), np.array([10, 1]), np.array([[7, 8], [2, 0]]), width=4)
    assert batch.positions.tolist() == [7, 8, 9, 0]
    assert batch.context_lens.tolist() == [10, 10, 10, 1]
    assert batch.tables.tolist() == [[7, 8, 0, 0]] * 3 + [[2, 0, 0, 0]]

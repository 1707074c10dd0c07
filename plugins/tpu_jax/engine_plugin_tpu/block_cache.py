"""The KV block pool as one JAX array for every layer, with a host (numpy) pool for swapping."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine_plugin_sdk import AttentionBackend, BlockCache, KVCacheSpec
from engine_plugin_sdk.block_ids import block_id_pairs
from engine_plugin_tpu.arrays import jax_dtype

#: the block axis of the pool ``[layers, 2, kv_heads, blocks, block_size, head_dim]``
BLOCK_AXIS = 3


@jax.jit
def _copy_blocks(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    # the gather reads every source before the scatter writes: overlapping pairs copy old contents
    return pool.at[:, :, :, dst].set(pool[:, :, :, src])


_copy_blocks_donated = jax.jit(_copy_blocks, donate_argnums=0)


@jax.jit
def _set_blocks(pool: jax.Array, dst: jax.Array, blocks: jax.Array) -> jax.Array:
    return pool.at[:, :, :, dst].set(blocks.astype(pool.dtype))


class LayerCaches(Sequence):
    """``kv_caches`` of a :class:`JaxBlockCache`: layer ``i`` reads ``pool[i]``; assigning replaces it.

    JAX arrays are immutable, so a caller that gets a new layer cache back (``write_kv`` returns one)
    stores it with ``block_cache.kv_caches[i] = new``; the pool array is updated functionally.
    """

    def __init__(self, owner: JaxBlockCache) -> None:
        self._owner = owner

    def __len__(self) -> int:
        return int(self._owner.pool.shape[0])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._owner.pool[i] for i in range(len(self))[index]]
        return self._owner.pool[index]

    def __setitem__(self, index: int, layer: Any) -> None:
        pool = self._owner.pool
        if tuple(layer.shape) != tuple(pool.shape[1:]):
            raise ValueError(f"a layer cache must have shape {tuple(pool.shape[1:])}, got {tuple(layer.shape)}")
        self._owner.pool = pool.at[index].set(jnp.asarray(layer, pool.dtype))

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))


class JaxBlockCache(BlockCache):
    """All layers' KV blocks in one JAX array ``pool`` ``[layers, *attention.kv_cache_shape(...)]``.

    The model runner passes ``pool`` into its jitted step with buffer donation and stores the step's
    result back, so the cache is updated in place on the device without a copy.

    Args:
        spec: cache geometry.
        num_blocks: blocks in the device pool.
        attention: fixes each layer's layout; it must be ``[2, kv_heads, blocks, block_size, dim]``.
        num_host_blocks: blocks in the host swap pool; default a quarter of ``num_blocks`` (at least 1).
        sharding: optional ``jax.sharding.Sharding`` of the pool (tensor parallelism splits kv heads).

    Raises:
        ValueError: for a non-positive block count or an unexpected layout.
    """

    supports_swap = True

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        attention: AttentionBackend,
        num_host_blocks: int | None = None,
        sharding: Any = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        num_host_blocks = max(1, num_blocks // 4) if num_host_blocks is None else num_host_blocks
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be non-negative, got {num_host_blocks}")
        layer_shape = tuple(attention.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim))
        if len(layer_shape) != 5 or layer_shape[BLOCK_AXIS - 1] != num_blocks:
            raise ValueError(f"JaxBlockCache needs a [2, kv_heads, blocks, block_size, dim] layout, got {layer_shape}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.dtype = jax_dtype(spec.dtype)
        # zeros, not garbage: padded head columns must stay zero, and stale NaNs would poison masked sums
        self.pool = jnp.zeros((spec.num_layers, *layer_shape), self.dtype, device=sharding)
        host_shape = list(self.pool.shape)
        host_shape[BLOCK_AXIS] = num_host_blocks
        self.host_pool = np.zeros(host_shape, dtype=self.dtype)
        self.kv_caches = LayerCaches(self)

    def copy_blocks(self, src_to_dst: list[tuple[int, int]]) -> None:
        if not src_to_dst:
            return
        src, dst = _index_pairs(src_to_dst, self.num_blocks, self.num_blocks, "copy_blocks")
        self.pool = _copy_blocks_donated(self.pool, jnp.asarray(src), jnp.asarray(dst))

    def swap_out(self, device_to_host: list[tuple[int, int]]) -> None:
        if not device_to_host:
            return
        src, dst = _index_pairs(device_to_host, self.num_blocks, self.num_host_blocks, "swap_out")
        self.host_pool[:, :, :, dst] = np.asarray(jax.device_get(self.pool[:, :, :, jnp.asarray(src)]))

    def swap_in(self, host_to_device: list[tuple[int, int]]) -> None:
        if not host_to_device:
            return
        src, dst = _index_pairs(host_to_device, self.num_host_blocks, self.num_blocks, "swap_in")
        self.pool = _set_blocks(self.pool, jnp.asarray(dst), jnp.asarray(self.host_pool[:, :, :, src]))


def _index_pairs(pairs: list[tuple[int, int]], src_limit: int, dst_limit: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    src, dst = block_id_pairs(pairs, src_limit, dst_limit, what)
    return src.numpy().astype(np.int32), dst.numpy().astype(np.int32)

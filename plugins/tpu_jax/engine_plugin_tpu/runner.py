"""The JAX model runner: weights converted once, the whole step under ``jax.jit`` with padded shape buckets.

Shape buckets are the plugin's graph capture: a step's token count, block-table width and number of
sampled rows are each padded up to a power of two, so a server compiles a handful of programs and then
replays them. The KV pool is donated to every step, so XLA updates it in place.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from engine_plugin_sdk import BlockCache, FlatStep, PlatformModelRunner, QuantizedWeight
from engine_plugin_sdk.models import ModelConfig, build_cos_sin_cache
from engine_plugin_tpu.arrays import jax_dtype, to_torch
from engine_plugin_tpu.attention import attend
from engine_plugin_tpu.model import SUPPORTED_ARCHITECTURES, LlamaShape, StepArrays, build_params, llama_step
from engine_plugin_tpu.paged_attention import TokenBatch, chunk_blocks, padded_head_dim, token_batch_from_seqs

logger = logging.getLogger(__name__)

#: smallest token and sampled-row buckets: tiny steps share one program
MIN_TOKEN_BUCKET = 8
MIN_ROW_BUCKET = 4


def bucket(n: int, minimum: int) -> int:
    """``n`` rounded up to a power of two, at least ``minimum``."""
    size = minimum
    while size < n:
        size *= 2
    return size


class JaxModelRunner(PlatformModelRunner):
    """Runs Llama-family models on JAX for the ``tpu`` platform.

    Args:
        config: the model's sizes.
        dtype: the model dtype name.
        attention_impl: ``"jnp"`` or ``"pallas"``.
        interpret: run the Pallas kernel in interpret mode (off-TPU).
        head_dim_multiple: pad the head dimension to this multiple (must match the attention backend).
        mesh: a ``jax.sharding.Mesh`` for tensor parallelism, or None for one device.
        jit: compile steps (False runs them op by op, for debugging: ``--enforce-eager``).

    Raises:
        ValueError: for an architecture this runner does not implement.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: str,
        attention_impl: str = "jnp",
        interpret: bool = True,
        head_dim_multiple: int = 1,
        mesh: Any = None,
        jit: bool = True,
    ) -> None:
        if config.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"the TPU/JAX runner does not implement {config.architecture!r}; supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        self.config = config
        self.dtype = jax_dtype(dtype)
        self.scale = config.head_dim**-0.5
        self.mesh = mesh
        self.shape = LlamaShape.from_config(config, padded_head_dim(config.head_dim, head_dim_multiple))
        self.params: Any = None
        attention = functools.partial(_attend_adapter, impl=attention_impl, interpret=interpret)
        step = functools.partial(llama_step, shape=self.shape, attend=attention)
        self._step = jax.jit(step, donate_argnums=1) if jit else step
        self.compiled_shapes: set[tuple[int, int, int]] = set()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        tensors: dict[str, np.ndarray] = {}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if isinstance(tensor, QuantizedWeight):
                # no packed kernels yet: quantized matrices are dequantized once, here
                tensor = tensor.dequantize()
            if isinstance(tensor, torch.Tensor):
                tensors[name] = tensor.detach().to(torch.float32).cpu().numpy()
            else:
                tensors[name] = np.asarray(tensor, dtype=np.float32)
        cfg = self.config
        cos_sin = build_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        params = build_params(tensors, cfg, cos_sin.numpy(), self.dtype)
        if self.mesh is not None:
            from engine_plugin_tpu.sharding import shard_params

            params = shard_params(params, self.mesh)
        self.params = params

    def compute_logits(self, step: FlatStep, block_cache: BlockCache) -> torch.Tensor:
        if self.params is None:
            raise RuntimeError("compute_logits() called before load_weights()")
        pool = getattr(block_cache, "pool", None)
        if pool is None:
            raise ValueError(f"the JAX runner needs the tpu platform's JaxBlockCache, got {type(block_cache).__name__}")
        arrays, rows = self._pad(step)
        logits, block_cache.pool = self._step(self.params, pool, arrays)
        return to_torch(logits)[:rows]

    def _pad(self, step: FlatStep) -> tuple[StepArrays, int]:
        n = step.num_tokens
        tokens = bucket(n, MIN_TOKEN_BUCKET)
        per_chunk = chunk_blocks(step.block_size)
        width = bucket(max(1, step.block_tables.shape[1]), per_chunk)
        rows = int(step.logits_indices.shape[0])
        row_bucket = bucket(rows, MIN_ROW_BUCKET)
        key = (tokens, width, row_bucket)
        if key not in self.compiled_shapes:
            self.compiled_shapes.add(key)
            logger.debug("compiling a step for %d tokens, %d table columns, %d sampled rows", *key)
        batch = token_batch_from_seqs(step.query_start_loc, step.seq_lens, step.block_tables, width)
        pad = tokens - n
        # padding tokens sit at position 0 of a one-token context in block 0, and write nowhere
        arrays = StepArrays(
            token_ids=np.pad(step.token_ids.astype(np.int32), (0, pad)),
            slots=np.pad(step.slot_mapping.astype(np.int32), (0, pad), constant_values=-1),
            batch=TokenBatch(
                tables=np.pad(batch.tables, ((0, pad), (0, 0))),
                positions=np.pad(batch.positions, (0, pad)),
                context_lens=np.pad(batch.context_lens, (0, pad), constant_values=1),
            ),
            logits_indices=np.pad(step.logits_indices.astype(np.int32), (0, row_bucket - rows)),
        )
        return jax.tree_util.tree_map(jnp.asarray, arrays), rows


def _attend_adapter(
    query: jax.Array,
    pool: jax.Array,
    batch: TokenBatch,
    scale: float,
    sliding_window: int | None,
    layer: Any,
    impl: str,
    interpret: bool,
) -> jax.Array:
    return attend(query, pool, batch, scale, True, sliding_window, None, impl, interpret, layer)

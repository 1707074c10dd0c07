"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) as one pure JAX step function over stacked layers.

Layer weights are stacked on a leading axis and the decoder runs as a ``lax.scan`` over it, so a
30-layer model compiles one layer body instead of thirty. The KV pool ``[layers, 2, kv_heads, blocks,
block_size, dim]`` is threaded through the scan's carry and updated with in-place scatters; the whole
step is meant to run under ``jax.jit`` with the pool donated (see :mod:`engine_plugin_tpu.runner`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from engine_plugin_sdk.models import ModelConfig, take_tensor
from engine_plugin_tpu.gemm import matmul
from engine_plugin_tpu.paged_attention import TokenBatch, write_kv

#: architectures this runner implements (the Llama layer with optional q/k/v biases)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The static sizes a compiled step depends on (hashable: a jit static argument)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    padded_head_dim: int
    rms_norm_eps: float
    sliding_window: int | None

    @classmethod
    def from_config(cls, config: ModelConfig, padded_head_dim: int) -> LlamaShape:
        return cls(
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            padded_head_dim,
            config.rms_norm_eps,
            config.sliding_window,
        )


class LayerParams(NamedTuple):
    """One decoder layer's weights; in :class:`LlamaParams` every field gains a leading layer axis."""

    input_norm: Any  # [H]
    wq: Any  # [H, heads * d]
    wk: Any  # [H, kv_heads * d]
    wv: Any
    bq: Any  # [heads * d] (zeros without attention bias)
    bk: Any
    bv: Any
    wo: Any  # [heads * d, H]
    bo: Any  # [H]
    post_norm: Any
    w_gate: Any  # [H, I]
    w_up: Any
    w_down: Any  # [I, H]


class LlamaParams(NamedTuple):
    embed: Any  # [V, H]
    layers: LayerParams  # stacked
    final_norm: Any  # [H]
    lm_head: Any  # [H, V]
    cos_sin: Any  # float32 [max_position, d]: cos in the first half, sin in the second


class StepArrays(NamedTuple):
    """One padded step's device inputs."""

    token_ids: Any  # int32 [T]
    slots: Any  # int32 [T], -1 for padding
    batch: TokenBatch  # tables [T, W], positions [T], context_lens [T]
    logits_indices: Any  # int32 [R]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * weight`` in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding of ``x`` ``[T, heads, d]`` by per-token ``cos``/``sin`` ``[T, d/2]``."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def llama_step(
    params: LlamaParams,
    pool: jax.Array,
    step: StepArrays,
    shape: LlamaShape,
    attend: Callable[..., jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """One forward step: write the new keys/values into ``pool``, attend, and return the wanted logits.

    Args:
        params: the weights.
        pool: the KV pool of every layer.
        step: the padded step.
        shape: static sizes.
        attend: ``attend(query, pool, batch, scale, sliding_window, layer) -> out``, the paged attention.

    Returns:
        float32 logits ``[R, vocab]`` of the rows in ``step.logits_indices``, and the updated pool.
    """
    num_tokens = step.token_ids.shape[0]
    d, dp = shape.head_dim, shape.padded_head_dim
    eps = shape.rms_norm_eps
    scale = d**-0.5
    cs = params.cos_sin[step.batch.positions]
    cos, sin = cs[:, : d // 2], cs[:, d // 2 :]
    hidden = params.embed[step.token_ids]

    def layer_fn(carry: tuple[jax.Array, jax.Array], xs: tuple[LayerParams, jax.Array]) -> tuple[Any, None]:
        h, pool = carry
        lp, layer = xs
        x = rms_norm(h, lp.input_norm, eps)
        q = (matmul(x, lp.wq) + lp.bq.astype(x.dtype)).reshape(num_tokens, shape.num_heads, d)
        k = (matmul(x, lp.wk) + lp.bk.astype(x.dtype)).reshape(num_tokens, shape.num_kv_heads, d)
        v = (matmul(x, lp.wv) + lp.bv.astype(x.dtype)).reshape(num_tokens, shape.num_kv_heads, d)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        pool = write_kv(pool, k, v, step.slots, layer)
        if dp > d:
            q = jnp.pad(q, ((0, 0), (0, 0), (0, dp - d)))
        attn = attend(q, pool, step.batch, scale, shape.sliding_window, layer)[..., :d]
        h = h + (matmul(attn.reshape(num_tokens, shape.num_heads * d), lp.wo) + lp.bo.astype(x.dtype))
        x = rms_norm(h, lp.post_norm, eps)
        gate, up = matmul(x, lp.w_gate), matmul(x, lp.w_up)
        h = h + matmul(jax.nn.silu(gate) * up, lp.w_down)
        return (h, pool), None

    num_layers = params.layers.input_norm.shape[0]
    (hidden, pool), _ = jax.lax.scan(layer_fn, (hidden, pool), (params.layers, jnp.arange(num_layers)))
    rows = rms_norm(hidden[step.logits_indices], params.final_norm, eps)
    logits = jnp.dot(
        rows, params.lm_head.astype(rows.dtype), precision=_precision(rows), preferred_element_type=jnp.float32
    )
    return logits, pool


def _precision(x: jax.Array) -> Any:
    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


def build_params(
    tensors: dict[str, np.ndarray], config: ModelConfig, cos_sin: np.ndarray, dtype: Any
) -> LlamaParams:
    """Stack HF-named float32 host arrays into :class:`LlamaParams` of ``dtype`` (weights as ``[in, out]``).

    Raises:
        ValueError: if a tensor is missing or has the wrong shape.
    """
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return take_tensor(tensors, name, shape)

    def optional(name: str, size: int) -> np.ndarray:
        return take(name, (size,)) if name in tensors else np.zeros((size,), np.float32)

    per_layer: list[LayerParams] = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        per_layer.append(
            LayerParams(
                input_norm=take(p + "input_layernorm.weight", (h,)),
                wq=take(p + "self_attn.q_proj.weight", (q_size, h)).T,
                wk=take(p + "self_attn.k_proj.weight", (kv_size, h)).T,
                wv=take(p + "self_attn.v_proj.weight", (kv_size, h)).T,
                bq=optional(p + "self_attn.q_proj.bias", q_size),
                bk=optional(p + "self_attn.k_proj.bias", kv_size),
                bv=optional(p + "self_attn.v_proj.bias", kv_size),
                wo=take(p + "self_attn.o_proj.weight", (h, q_size)).T,
                bo=optional(p + "self_attn.o_proj.bias", h),
                post_norm=take(p + "post_attention_layernorm.weight", (h,)),
                w_gate=take(p + "mlp.gate_proj.weight", (inter, h)).T,
                w_up=take(p + "mlp.up_proj.weight", (inter, h)).T,
                w_down=take(p + "mlp.down_proj.weight", (h, inter)).T,
            )
        )
    embed = take("model.embed_tokens.weight", (config.vocab_size, h))
    if config.tie_word_embeddings or "lm_head.weight" not in tensors:
        lm_head = embed.T
    else:
        lm_head = take("lm_head.weight", (config.vocab_size, h)).T
    tensors.pop("lm_head.weight", None)
    layers = LayerParams(*(jnp.asarray(np.stack(field), dtype) for field in zip(*per_layer)))
    return LlamaParams(
        embed=jnp.asarray(embed, dtype),
        layers=layers,
        final_norm=jnp.asarray(take("model.norm.weight", (h,)), dtype),
        lm_head=jnp.asarray(lm_head, dtype),
        cos_sin=jnp.asarray(cos_sin, jnp.float32),
    )

"""Which architectures the loader accepts, and the parameter names and shapes each one must have."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.loader.errors import ModelLoadError
from engine.models.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# Buffers some checkpoints carry that the model recomputes; they are not parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def supported_architectures() -> list[str]:
    """Return the HF ``architectures`` names the loader can load, e.g. ``"LlamaForCausalLM"``."""
    return list(SUPPORTED_ARCHITECTURES)


def check_architecture(config: ModelConfig, source: str) -> None:
    """Raise ModelLoadError unless ``config`` names a supported architecture.

    Args:
        config: the parsed model config.
        source: the file it came from, for the message.

    Raises:
        ModelLoadError: the architecture is not one of :func:`supported_architectures`.
    """
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture '{config.architecture}' in {source}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Return every parameter a checkpoint of ``config`` must provide, by HF name, in load order.

    Args:
        config: the model config.

    Returns:
        HF parameter name -> shape in HF orientation (``[out_features, in_features]`` for linears).
        ``lm_head.weight`` is absent when the embeddings are tied. With ``attention_bias``, q/k/v get
        biases, and so does o_proj except for Qwen2 (as in the HF models).
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_size, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_size, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_size, hidden)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_size,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_size)
        if config.attention_bias and config.architecture != "Qwen2ForCausalLM":
            # HF Llama/Mistral's attention_bias also covers o_proj; Qwen2 has q/k/v biases only.
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def is_norm_weight(name: str) -> bool:
    """Say whether ``name`` is an RMSNorm scale (initialised near 1 rather than near 0)."""
    return name.endswith("layernorm.weight") or name == "model.norm.weight"


def check_weight_stream(
    weights: Iterator[tuple[str, torch.Tensor]], config: ModelConfig, source: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``weights`` through, failing on a tensor the model does not have, a wrong shape, a repeat,
    or (after the last one) a missing tensor, so a bad checkpoint never loads half-way silently.

    Args:
        weights: (HF name, tensor) pairs from a checkpoint.
        config: the model config the checkpoint must match.
        source: the checkpoint path, for messages.

    Returns:
        An iterator over the same pairs.

    Raises:
        ModelLoadError: the checkpoint does not match ``config``.
    """
    expected = expected_weight_shapes(config)
    seen: set[str] = set()
    for name, tensor in weights:
        shape = expected.get(name)
        if shape is None:
            raise ModelLoadError(f"unexpected tensor '{name}' in {source} for {config.architecture}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"tensor '{name}' in {source} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        if name in seen:
            raise ModelLoadError(f"tensor '{name}' appears twice in {source}")
        seen.add(name)
        yield name, tensor
    missing = [name for name in expected if name not in seen]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelLoadError(f"checkpoint {source} lacks tensor '{missing[0]}'{more}")

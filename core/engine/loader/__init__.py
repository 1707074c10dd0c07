"""Loading models: HF folders and GGUF files (config, weights, tokenizer), dummy weights for benchmarks."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from engine.interfaces.gemm import QuantizedWeight
from engine.loader.architectures import (
    check_weight_stream,
    expected_weight_shapes,
    registry_or_core,
    supported_architectures,
)
from engine.loader.dummy import dummy_weights
from engine.loader.errors import ModelLoadError
from engine.loader.gguf_file import iter_gguf_weights, load_gguf_config
from engine.loader.hf_folder import check_hf_weights, iter_hf_weights, load_hf_config
from engine.loader.lazy_tensor import LazyTensor
from engine.loader.paths import default_model_path, is_gguf_file, resolve_model_path
from engine.loader.prequantized import checkpoint_quantization, regroup_quantized
from engine.loader.tokenizer import Tokenizer, load_tokenizer
from engine.models.config import ModelConfig

if TYPE_CHECKING:
    from engine.models.registry import ModelRegistry

__all__ = [
    "ModelLoadError",
    "Tokenizer",
    "default_model_path",
    "dummy_weights",
    "expected_weight_shapes",
    "is_gguf_file",
    "iter_weights",
    "load_model_config",
    "load_tokenizer",
    "resolve_model_path",
    "supported_architectures",
]


def load_model_config(
    path: str, *, check_weights: bool = True, registry: ModelRegistry | None = None
) -> ModelConfig:
    """Read a model's config and check its weight files are complete, before anything is allocated.

    Args:
        path: a HF model folder (with config.json) or a ``.gguf`` file.
        check_weights: also check a HF folder's weight files (safetensors headers against file sizes);
            pass False for a config-only folder used with dummy weights. GGUF files are always checked.
        registry: the architectures that may load (an engine passes the one with its plugins' models);
            default: the core's architectures only.

    Returns:
        The model config.

    Raises:
        ModelLoadError: unknown path, no config.json, unsupported architecture, or truncated/corrupt
            config, safetensors or GGUF file.
    """
    if not os.path.exists(path):
        raise ModelLoadError(f"model path '{path}' does not exist")
    registry = registry_or_core(registry)
    if is_gguf_file(path):
        config = load_gguf_config(path, registry)
    elif path.endswith(".gguf") and os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path} is truncated or corrupt (it does not start with 'GGUF')")
    elif os.path.isdir(path):
        config = load_hf_config(path, registry)
        checkpoint_quantization(config.hf_config, path)  # a malformed quantization_config fails here
        if check_weights:
            check_hf_weights(path)
    else:
        raise ModelLoadError(
            f"model path '{path}' is neither a model folder with config.json nor a GGUF file"
        )
    registry.resolve(config.architecture, path)
    return config


def iter_weights(
    path: str,
    config: ModelConfig,
    keep_quantized: frozenset[str] = frozenset(),
    registry: ModelRegistry | None = None,
    lazy: bool = False,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight | LazyTensor]]:
    """Yield every parameter of the model at ``path`` by HF name, as CPU tensors in HF orientation.

    HF folders keep the checkpoint dtype; GGUF tensors are dequantised to float32 with the Q/K rows put
    back in HF's rotary order. ``lm_head.weight`` is absent when ``config.tie_word_embeddings``.

    Args:
        path: the same path given to :func:`load_model_config`.
        config: the config it returned.
        keep_quantized: quantization schemes (a GEMM backend's ``supported_quant_schemes``) whose
            matrices are yielded as :class:`QuantizedWeight` rather than dequantised (GGUF files, and HF
            folders quantized ahead of time: GPTQ, AWQ, compressed-tensors, FP8).
        registry: the registry given to :func:`load_model_config`; the resolved class names the tensors
            the stream must hold (default: the core's architectures only).
        lazy: yield a HF folder's safetensors tensors unread (:class:`LazyTensor`: the consumer reads the
            windows it keeps with :func:`~engine.loader.lazy_tensor.materialize`).

    Returns:
        An iterator of (name, tensor) pairs, with a progress bar on a terminal.

    Raises:
        ModelLoadError: a weight file is unreadable, or its tensors do not match ``config`` (unexpected,
            wrongly shaped, or missing once the iterator is exhausted).
    """
    model_class = registry_or_core(registry).resolve(config.architecture, path)
    if is_gguf_file(path):
        weights = iter_gguf_weights(path, config, model_class, keep_quantized)
    elif os.path.isdir(path):
        weights = iter_hf_weights(path, config, model_class, lazy)
        quant = checkpoint_quantization(config.hf_config, path)
        if quant is not None:
            weights = regroup_quantized(weights, quant, keep_quantized, model_class.weight_shapes(config))
    else:
        raise ModelLoadError(f"model path '{path}' is neither a model folder nor a GGUF file")
    checked = check_weight_stream(weights, config, path, model_class)
    total = len(model_class.weight_shapes(config))
    yield from tqdm(
        checked, total=total, desc="Loading weights", leave=False, disable=not sys.stderr.isatty()
    )

"""GGUF files (llama.cpp's format): metadata to ModelConfig, tensors to HF names in float32."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.interfaces.gemm import QuantizedWeight
from engine.loader.architectures import registry_or_core
from engine.loader.errors import ModelLoadError
from engine.loader.gguf_config import GGUF_KINDS, field_value, gguf_hf_config
from engine.loader.gguf_reader import GgufFile, GgufTensor
from engine.loader.quantized import (
    dequantize_gguf_bytes,
    gguf_quantized_weight,
    gguf_scheme,
    make_gguf_weight,
    map_rows,
)
from engine.loader.weight_slices import weight_rows
from engine.models.config import ModelConfig

if TYPE_CHECKING:
    from engine.models.base import CausalLM
    from engine.models.registry import ModelRegistry

# Which GGUF `general.architecture` values load, under which HF name, how tensor names map and which
# rows were permuted: all of it comes from the registered model classes (CausalLM.gguf_*).

# The types gguf's numpy dequantiser handles at a tolerable speed, or the loader's own in torch (IQ4_NL / IQ4_XS:
# engine.loader.grouped_codes).
DEQUANTIZABLE_TYPES = frozenset(
    {
        GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K, GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS,
        GGMLQuantizationType.MXFP4,
    }
)  # fmt: skip

# a per-layer tensor's block index
GGUF_LAYER_INDEX = re.compile(r"^blk\.(\d+)\.")

# Tensors llama.cpp stores that the HF model recomputes (rotary frequencies; Phi-3's longrope factors are
# read into the config).
SKIPPED_TENSOR_PATTERN = re.compile(
    r"^(rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd(\.weight)?)$"
)
READER_ERRORS = (ValueError, OSError, struct.error, IndexError, KeyError, UnicodeDecodeError, TypeError)


def open_gguf(path: str) -> GgufFile:
    """Open a GGUF file and check that every tensor's bytes lie inside it.

    Args:
        path: the ``.gguf`` file.

    Returns:
        The parsed file (metadata, tensor infos, memory-mapped tensor data).

    Raises:
        ModelLoadError: the file is truncated or not a valid GGUF file.
    """
    try:
        reader = GgufFile(path)
    except READER_ERRORS as err:
        raise ModelLoadError(f"GGUF file {path} is truncated or corrupt ({err})") from None
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        if int(tensor.data_offset) + int(tensor.n_bytes) > size:
            raise ModelLoadError(f"GGUF file {path} is truncated (tensor '{tensor.name}' runs past the end)")
    return reader


def gguf_architecture(reader: GgufFile, path: str) -> str:
    """Return a GGUF file's ``general.architecture`` (``"llama"``, ``"qwen2"``, ...).

    Raises:
        ModelLoadError: the file has none.
    """
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError(f"GGUF file {path} has no 'general.architecture'")
    return str(field_value(field))


def model_kind(reader: GgufFile, gguf_arch: str, kinds: Mapping[str, str]) -> str:
    """The kind a file resolves as: ``<arch>:experts`` for a file with experts when a class loads that
    (llama.cpp writes Mixtral as ``llama`` with ``llama.expert_count``), else ``gguf_arch``."""
    experts = reader.fields.get(f"{gguf_arch}.expert_count")
    if experts is not None and int(field_value(experts)) > 0 and f"{gguf_arch}:experts" in kinds:
        return f"{gguf_arch}:experts"
    return gguf_arch


def load_gguf_config(path: str, registry: ModelRegistry | None = None) -> ModelConfig:
    """Build a ModelConfig from a GGUF file's metadata, checking every tensor can be dequantised.

    The metadata becomes the HF config dict it was converted from (:func:`gguf_hf_config`, one table
    entry per llama.cpp architecture), read by the model class's ``config_from_hf`` as a HF folder's
    would be. A kind the table does not list (a plugin's) gets the common keys read as Llama-family keys,
    with an empty ``hf_config``.

    Args:
        path: the ``.gguf`` file.
        registry: maps ``general.architecture`` to a HF name through its classes' ``gguf_architectures``
            (default: the core's architectures only).

    Returns:
        The model config, with ``torch_dtype="float32"`` (weights are dequantised to float32).

    Raises:
        ModelLoadError: truncated/corrupt file, unsupported architecture or tensor type, missing metadata.
    """
    reader = open_gguf(path)
    gguf_arch = gguf_architecture(reader, path)
    models = registry_or_core(registry)
    hf_arch = models.resolve_gguf(model_kind(reader, gguf_arch, models.gguf_architectures()), path)
    for tensor in reader.tensors:
        if tensor.tensor_type not in DEQUANTIZABLE_TYPES:
            raise ModelLoadError(
                f"tensor '{tensor.name}' in {path} has GGUF type {tensor.tensor_type.name}, which the "
                f"loader cannot dequantise; supported: {', '.join(t.name for t in DEQUANTIZABLE_TYPES)}"
            )
    hf = gguf_hf_config(reader, gguf_arch, hf_arch, path)
    # a kind's derive may pick among the HF architectures its files stand for (deepseek2: V2 or V3 routing)
    hf_arch = hf["architectures"][0]
    try:
        if gguf_arch not in GGUF_KINDS:
            config = ModelConfig.from_hf_dict(hf)
            config.hf_config = {}
            return config
        config = models.resolve(hf_arch, path).config_from_hf(hf)
    except KeyError as err:
        raise ModelLoadError(f"GGUF file {path} lacks the metadata for {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"GGUF file {path} has an invalid value: {err}") from None
    # the file decides these, whatever the class's defaults for a config.json that leaves them out
    config.vocab_size, config.tie_word_embeddings, config.torch_dtype = int(hf["vocab_size"]), bool(hf["tie_word_embeddings"]), "float32"
    config.hf_config = hf
    return config


def hf_tensor_name(gguf_name: str, model_class: type[CausalLM]) -> str | None:
    """Map a llama.cpp tensor name to its HF name; None for tensors the HF model does not keep.

    Args:
        gguf_name: the tensor's name in the file.
        model_class: the resolved model class, whose ``gguf_tensor_name`` knows its names.

    Raises:
        ModelLoadError: a name the model class does not know.
    """
    if SKIPPED_TENSOR_PATTERN.match(gguf_name):
        return None
    try:
        return model_class.gguf_tensor_name(gguf_name)
    except KeyError:
        raise ModelLoadError(f"unknown GGUF tensor '{gguf_name}' for {model_class.__name__}") from None


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order.

    HF's rotary pairs dimension i with i + head_dim/2 inside each head; llama.cpp pairs adjacent rows,
    so its converter interleaved the two halves of every head. Viewing each head as (head_dim/2, 2) and
    swapping the axes gives the halves back. Works for weights (rows x in) and biases (rows).

    Args:
        weight: Q or K projection weight or bias in llama.cpp row order.
        num_heads: heads the rows are split into (query heads for Q, KV heads for K).

    Returns:
        The tensor in HF row order.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    tail = tuple(weight.shape[1:])
    return weight.reshape(num_heads, half, 2, *tail).transpose(1, 2).reshape(rows, *tail).contiguous()


def dequantize_tensor(tensor: GgufTensor) -> torch.Tensor:
    """Dequantise one GGUF tensor to a float32 CPU tensor in HF orientation (rows = out features)."""
    # Row-major data whose ggml shape is [in, out] dequantises to (out, in), HF's Linear layout.
    rows = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        array = dequantize(tensor.data, tensor.tensor_type)
        # Plain F32 tensors come back as a read-only view of the memory map; torch needs its own copy.
        if array.dtype != np.float32 or not array.flags.writeable:
            array = array.astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(array)).reshape(rows)
    # a private copy of the memory-mapped bytes (torch refuses read-only arrays); a seventh of the output
    data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
    return dequantize_gguf_bytes(data, tensor.tensor_type, rows)


def iter_gguf_weights(
    path: str,
    config: ModelConfig,
    model_class: type[CausalLM],
    keep_quantized: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield a GGUF file's tensors by HF name as float32, Q/K rows in HF order, the converter's value
    changes undone (``CausalLM.gguf_restore``).

    Args:
        path: the ``.gguf`` file.
        config: its model config.
        model_class: the resolved model class (tensor names and permuted rows come from it).
        keep_quantized: scheme names (``"gguf_q4_1"``, ...) whose matrices are yielded as
            :class:`QuantizedWeight` (GGUF block bytes, see :mod:`engine.loader.quantized`) instead.

    Raises:
        ModelLoadError: a truncated file, an unknown tensor name or an unsupported tensor type.
    """
    reader = open_gguf(path)
    gguf_arch = gguf_architecture(reader, path)
    for tensor in reader.tensors:
        layer = GGUF_LAYER_INDEX.match(tensor.name)
        if layer is not None and int(layer.group(1)) >= config.num_layers:
            continue  # the multi-token-prediction blocks some converters append (GLM-4.5's nextn layer)
        name = hf_tensor_name(tensor.name, model_class)
        if name is None:
            continue
        if tensor.tensor_type not in DEQUANTIZABLE_TYPES:
            raise ModelLoadError(
                f"tensor '{tensor.name}' in {path} has unsupported GGUF type {tensor.tensor_type.name}"
            )
        quantized = gguf_scheme(tensor.tensor_type) in keep_quantized
        if "{}" in name and len(tensor.shape) == 3:
            parts = [(name.replace("{}", str(e)), w) for e, w in enumerate(expert_matrices(tensor, quantized))]
        elif "{}" in name:  # the experts' biases, a row each
            parts = [(name.replace("{}", str(e)), row) for e, row in enumerate(dequantize_tensor(tensor).unbind(0))]
        else:
            parts = [(name, gguf_quantized_weight(tensor) if quantized and len(tensor.shape) == 2 else dequantize_tensor(tensor))]
        for part_name, weight in split_fused(parts):
            heads = model_class.gguf_permuted_heads(gguf_arch, part_name, config)
            if heads:
                weight = reorder_rows(weight, lambda rows, h=heads: unpermute_rotary_rows(rows, h))
            yield from model_class.gguf_restore(gguf_arch, part_name, weight, config)


def split_fused(parts: list[tuple[str, torch.Tensor | QuantizedWeight]]) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Tensors whose HF name joins several with ``+`` (a fused gate/up, ``ffn_gate_up_exps``), cut into those
    by equal runs of rows in order."""
    for name, weight in parts:
        names = name.split("+")
        rows = int(weight.shape[0]) // len(names)
        for i, part in enumerate(names):
            yield part, weight if len(names) == 1 else weight_rows(weight, slice(i * rows, (i + 1) * rows))


def expert_matrices(tensor: GgufTensor, quantized: bool) -> Iterator[torch.Tensor | QuantizedWeight]:
    """A stacked-expert tensor (ggml ``[in, out, experts]``) one expert's ``[out, in]`` matrix at a time:
    its GGUF blocks when ``quantized``, else float32 (each expert dequantised alone, so that a layer's
    experts never stand in float32 at once)."""
    in_features, out_features, experts = (int(d) for d in tensor.shape.tolist())
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        whole = dequantize_tensor(tensor).reshape(experts, out_features, in_features)
        yield from whole.unbind(0)
        return
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(experts, out_features, -1)
    for e in range(experts):
        data = torch.from_numpy(np.array(raw[e], copy=True))
        weight = make_gguf_weight(data, tensor.tensor_type, (out_features, in_features))
        yield weight if quantized else weight.dequantize()


def reorder_rows(
    weight: torch.Tensor | QuantizedWeight, rows_fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | QuantizedWeight:
    """Apply a function of the rows to a dense or a quantized weight (rows are independent in both)."""
    return map_rows(weight, rows_fn) if isinstance(weight, QuantizedWeight) else rows_fn(weight)

"""GGUF files (llama.cpp's format): metadata to ModelConfig, tensors to HF names in float32."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import dequantize

from engine.interfaces.gemm import QuantizedWeight
from engine.loader.architectures import SUPPORTED_ARCHITECTURES
from engine.loader.errors import ModelLoadError
from engine.loader.quantized import gguf_quantized_weight, gguf_scheme, map_rows
from engine.models.config import ModelConfig

# GGUF `general.architecture` -> HF architecture name. Mistral GGUFs say "llama".
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Architectures whose converter permuted the Q/K rows for llama.cpp's rotary layout.
PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

# The types gguf's numpy dequantiser handles at a tolerable speed.
DEQUANTIZABLE_TYPES = frozenset(
    {
        GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)  # fmt: skip

GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Tensors llama.cpp stores that the HF model recomputes (rotary frequencies).
SKIPPED_TENSOR_PATTERN = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?)$")
LAYER_TENSOR_PATTERN = re.compile(r"^blk\.(\d+)\.(.+)$")
READER_ERRORS = (ValueError, OSError, struct.error, IndexError, KeyError, UnicodeDecodeError, TypeError)


def open_gguf(path: str) -> GGUFReader:
    """Open a GGUF file and check that every tensor's bytes lie inside it.

    Raises:
        ModelLoadError: the file is truncated or not a valid GGUF file.
    """
    try:
        reader = GGUFReader(path, "r")
    except READER_ERRORS as err:
        raise ModelLoadError(f"GGUF file {path} is truncated or corrupt ({err})") from None
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        if int(tensor.data_offset) + int(tensor.n_bytes) > size:
            raise ModelLoadError(f"GGUF file {path} is truncated (tensor '{tensor.name}' runs past the end)")
    return reader


def field_value(field: ReaderField) -> str | int | float | bool:
    """Decode a scalar or string metadata field."""
    kind = field.types[0]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == GGUFValueType.ARRAY:
        raise ModelLoadError(f"GGUF field '{field.name}' is an array, expected a single value")
    return field.parts[field.data[0]][0].item()


def gguf_hf_architecture(reader: GGUFReader, path: str) -> tuple[str, str]:
    """Return (GGUF architecture, HF architecture) of a GGUF file.

    Raises:
        ModelLoadError: no ``general.architecture`` or one the engine does not support.
    """
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError(f"GGUF file {path} has no 'general.architecture'")
    gguf_arch = str(field_value(field))
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture '{gguf_arch}' in GGUF file {path}; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)} (as {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return gguf_arch, GGUF_ARCHITECTURES[gguf_arch]


def load_gguf_config(path: str) -> ModelConfig:
    """Build a ModelConfig from a GGUF file's metadata, checking every tensor can be dequantised.

    Args:
        path: the ``.gguf`` file.

    Returns:
        The model config, with ``torch_dtype="float32"`` (weights are dequantised to float32).

    Raises:
        ModelLoadError: truncated/corrupt file, unsupported architecture or tensor type, missing metadata.
    """
    reader = open_gguf(path)
    gguf_arch, hf_arch = gguf_hf_architecture(reader, path)
    for tensor in reader.tensors:
        if tensor.tensor_type not in DEQUANTIZABLE_TYPES:
            raise ModelLoadError(
                f"tensor '{tensor.name}' in {path} has GGUF type {tensor.tensor_type.name}, which the "
                f"loader cannot dequantise; supported: {', '.join(t.name for t in DEQUANTIZABLE_TYPES)}"
            )

    def meta(key: str, default: str | int | float | bool | None = None) -> str | int | float | bool:
        field = reader.fields.get(f"{gguf_arch}.{key}") or reader.fields.get(key)
        if field is None:
            if default is None:
                raise ModelLoadError(f"GGUF file {path} lacks metadata '{gguf_arch}.{key}'")
            return default
        return field_value(field)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"GGUF file {path} has no 'token_embd.weight' tensor")
    # The embedding's row count, not the token list, since some files pad the matrix past the tokens;
    # ggml lists dimensions innermost first, so the row count is the last one.
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    rope_scaling = None
    scaling_type = reader.fields.get(f"{gguf_arch}.rope.scaling.type")
    if scaling_type is not None and field_value(scaling_type) == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in reader.fields and int(field_value(reader.fields[key])) not in eos_ids:
            eos_ids.append(int(field_value(reader.fields[key])))
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    sliding = reader.fields.get(f"{gguf_arch}.attention.sliding_window")
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=hf_arch == "Qwen2ForCausalLM" or "blk.0.attn_q.bias" in tensors,
        sliding_window=int(field_value(sliding)) if sliding is not None else None,
        bos_token_id=int(field_value(bos)) if bos is not None else None,
        eos_token_ids=eos_ids,
        torch_dtype="float32",
    )


def hf_tensor_name(gguf_name: str) -> str | None:
    """Map a llama.cpp tensor name to its HF name; None for tensors the HF model does not keep.

    Raises:
        ModelLoadError: a name the loader does not know.
    """
    if gguf_name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[gguf_name]
    if SKIPPED_TENSOR_PATTERN.match(gguf_name):
        return None
    match = LAYER_TENSOR_PATTERN.match(gguf_name)
    if match and match.group(2) in LAYER_TENSOR_NAMES:
        return f"model.layers.{match.group(1)}.{LAYER_TENSOR_NAMES[match.group(2)]}"
    raise ModelLoadError(f"unknown GGUF tensor '{gguf_name}'")


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


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """Dequantise one GGUF tensor to a float32 CPU tensor in HF orientation (rows = out features)."""
    array = dequantize(tensor.data, tensor.tensor_type)
    # Plain F32 tensors come back as a read-only view of the memory map; torch needs its own copy.
    if array.dtype != np.float32 or not array.flags.writeable:
        array = array.astype(np.float32)
    # Row-major data whose ggml shape is [in, out] dequantises to (out, in), HF's Linear layout.
    rows = [int(d) for d in reversed(tensor.shape.tolist())]
    return torch.from_numpy(np.ascontiguousarray(array)).reshape(rows)


def iter_gguf_weights(
    path: str, config: ModelConfig, keep_quantized: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield a GGUF file's tensors by HF name as float32, Q/K rows in HF order.

    Args:
        path: the ``.gguf`` file.
        config: its model config.
        keep_quantized: scheme names (``"gguf_q4_1"``, ...) whose matrices are yielded as
            :class:`QuantizedWeight` (GGUF block bytes, see :mod:`engine.loader.quantized`) instead.

    Raises:
        ModelLoadError: a truncated file, an unknown tensor name or an unsupported tensor type.
    """
    reader = open_gguf(path)
    gguf_arch, _ = gguf_hf_architecture(reader, path)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        if tensor.tensor_type not in DEQUANTIZABLE_TYPES:
            raise ModelLoadError(
                f"tensor '{tensor.name}' in {path} has unsupported GGUF type {tensor.tensor_type.name}"
            )
        weight: torch.Tensor | QuantizedWeight
        if gguf_scheme(tensor.tensor_type) in keep_quantized and len(tensor.shape) == 2:
            weight = gguf_quantized_weight(tensor)
        else:
            weight = dequantize_tensor(tensor)
        if gguf_arch in PERMUTED_QK_ARCHITECTURES:
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads if ".k_proj." in name else 0
            if heads:
                weight = reorder_rows(weight, lambda rows, h=heads: unpermute_rotary_rows(rows, h))
        yield name, weight


def reorder_rows(
    weight: torch.Tensor | QuantizedWeight, rows_fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | QuantizedWeight:
    """Apply a function of the rows to a dense or a quantized weight (rows are independent in both)."""
    return map_rows(weight, rows_fn) if isinstance(weight, QuantizedWeight) else rows_fn(weight)

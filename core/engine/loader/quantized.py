"""Quantized GGUF tensors kept in their storage format, and row-wise edits of any :class:`QuantizedWeight`.

Rows (output features) of a quantized weight are independent in every scheme the plugin API names: a
GGUF row is a run of whole blocks, and per-channel scales belong to their row. So reordering rows (the
Q/K rotary un-permutation) and stacking weights along the output dimension (fused q/k/v, gate/up) can be
done on the storage itself, without dequantising.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.interfaces.gemm import QuantizedWeight
from engine.loader.gguf_reader import GgufTensor
from engine.loader.grouped_codes import GGUF_GROUPED_FORMS, dequantize_codes, grouped_codes

GGUF_SCHEME_PREFIX = "gguf_"
#: ``extra`` fields indexed by input column, never by row, whatever their length (grouped_int's ``perm``)
COLUMN_FIELDS = frozenset({"perm"})


def gguf_scheme(qtype: GGMLQuantizationType) -> str:
    """The plugin-API scheme name of a GGUF tensor type (``Q4_1`` -> ``"gguf_q4_1"``)."""
    return GGUF_SCHEME_PREFIX + qtype.name.lower()


def gguf_quantized_weight(tensor: GgufTensor) -> QuantizedWeight:
    """A 2-D GGUF tensor as a :class:`QuantizedWeight` in the layout ``engine_plugin_sdk.quant`` documents.

    ``data`` is ``torch.uint8 [out_features, bytes_per_row]`` (GGUF blocks row by row, a private copy of
    the file's bytes), ``extra["ggml_type"]`` the ``GGMLQuantizationType`` value.

    Raises:
        ValueError: for a tensor that is not 2-D.
    """
    if len(tensor.shape) != 2:
        raise ValueError(
            f"GGUF tensor '{tensor.name}' has {len(tensor.shape)} dimensions; only matrices stay quantized"
        )
    # ggml lists dimensions innermost first: [in, out]
    in_features, out_features = (int(d) for d in tensor.shape.tolist())
    raw = np.array(tensor.data, dtype=np.uint8, copy=True)
    data = torch.from_numpy(raw).reshape(out_features, -1)
    return make_gguf_weight(data, tensor.tensor_type, (out_features, in_features))


def make_gguf_weight(
    data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> QuantizedWeight:
    """Wrap GGUF block bytes ``[out, bytes_per_row]`` with a float32 ``dequantize``."""

    def dequantize_gguf() -> torch.Tensor:
        return dequantize_gguf_bytes(data, qtype, shape)

    return QuantizedWeight(
        GGUF_SCHEME_PREFIX + qtype.name.lower(), data, shape, dequantize_gguf, {"ggml_type": int(qtype)}
    )


def dequantize_gguf_bytes(data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """GGUF blocks ``[rows, bytes_per_row]`` as float32 of ``shape``, bit for bit ``gguf.quants``' values.

    The types with a grouped-integer form unpack in torch (:mod:`engine.loader.grouped_codes`, about
    five times faster on the embedded model); the others go through ``gguf.quants``.
    """
    scheme = gguf_scheme(qtype)
    if scheme in GGUF_GROUPED_FORMS:
        rows = data.reshape(-1, data.shape[-1])
        flat = (rows.shape[0], math.prod(shape) // rows.shape[0])
        # only unpacked here: it needs no dequantize of its own
        weight = QuantizedWeight(scheme, rows, flat, None, {"ggml_type": int(qtype)})
        return dequantize_codes(grouped_codes(weight, torch.device("cpu"))).reshape(shape)
    dense = dequantize(data.numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).reshape(shape)


def map_rows(weight: QuantizedWeight, rows_fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
    """Apply a row reordering ``rows_fn`` (a function of dim 0 only) to a quantized weight.

    ``rows_fn`` is applied to ``data`` and to every tensor in ``extra`` with one entry per row (scales),
    and composed onto ``dequantize``.
    """
    rows = weight.shape[0]
    extra = {k: rows_fn(v) if _is_per_row(k, v, rows) else v for k, v in weight.extra.items()}
    old = weight.dequantize

    def dequantize_mapped() -> torch.Tensor:
        return rows_fn(old())

    if weight.scheme.startswith(GGUF_SCHEME_PREFIX):
        return make_gguf_weight(
            rows_fn(weight.data), GGMLQuantizationType(weight.extra["ggml_type"]), weight.shape
        )
    return QuantizedWeight(weight.scheme, rows_fn(weight.data), weight.shape, dequantize_mapped, extra)


def concat_rows(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Stack quantized weights of one scheme and input width along the output dimension.

    Raises:
        ValueError: if the weights differ in scheme, input width or a non-per-row ``extra`` field.
    """
    first = weights[0]
    for w in weights[1:]:
        if w.scheme != first.scheme or w.shape[1] != first.shape[1]:
            raise ValueError(
                f"cannot stack quantized weights {first.scheme} {first.shape} and {w.scheme} {w.shape} by rows"
            )
    shape = (sum(w.shape[0] for w in weights), first.shape[1])
    data = torch.cat([w.data for w in weights], dim=0)
    if first.scheme.startswith(GGUF_SCHEME_PREFIX):
        return make_gguf_weight(data, GGMLQuantizationType(first.extra["ggml_type"]), shape)
    extra: dict[str, object] = {}
    for key, value in first.extra.items():
        if _is_per_row(key, value, first.shape[0]):
            extra[key] = torch.cat([w.extra[key] for w in weights], dim=0)
        elif all(_same(w.extra.get(key), value) for w in weights):
            extra[key] = value
        else:
            raise ValueError(f"cannot stack quantized weights whose extra[{key!r}] differ")
    parts = list(weights)

    def dequantize_stacked() -> torch.Tensor:
        return torch.cat([w.dequantize() for w in parts], dim=0)

    return QuantizedWeight(first.scheme, data, shape, dequantize_stacked, extra)


def concat_weights(weights: Sequence[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """Stack weights along the output dimension: quantized ones stay quantized when all share a scheme,
    a mix is dequantised to float32 first."""
    if all(isinstance(w, QuantizedWeight) for w in weights):
        quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
        # act-order GPTQ projections whose column orders differ do not stack quantized: dense below
        if _stackable(quantized):
            return concat_rows(quantized)
    dense = [w.dequantize() if isinstance(w, QuantizedWeight) else w for w in weights]
    return torch.cat(dense, dim=0)


def stacks_quantized(weights: Sequence[torch.Tensor | QuantizedWeight]) -> bool:
    """Whether :func:`concat_weights` keeps these quantized (all quantized alike) rather than dequantizing."""
    quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
    return len(quantized) == len(weights) and _stackable(quantized)


def _is_per_row(key: str, value: object, rows: int) -> bool:
    return key not in COLUMN_FIELDS and isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows


def _stackable(weights: Sequence[QuantizedWeight]) -> bool:
    first = weights[0]
    if any(w.scheme != first.scheme or w.shape[1] != first.shape[1] for w in weights):
        return False
    shared = [k for k, v in first.extra.items() if not _is_per_row(k, v, first.shape[0])]
    return all(_same(w.extra.get(k), first.extra[k]) for w in weights for k in shared)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a is b or a == b

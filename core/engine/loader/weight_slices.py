"""A tensor-parallel rank's slice of a checkpoint weight, whatever form the loader gave it in: a tensor, an
unread :class:`~engine.loader.lazy_tensor.LazyTensor` (the slice stays unread), or a quantized weight.

A GGUF weight is sliced in its storage: its rows are runs of whole blocks, so any rows can be taken, and
its columns can be cut at block boundaries (the input widths a split produces, such as half of 4096, fall
on them). A grouped-integer weight (GPTQ, AWQ, compressed-tensors) likewise: any rows, and columns at group
boundaries where it has no act-order permutation. A whole weight is itself. A quantized weight that cannot be
cut where asked is dequantized first; the rank then holds that slice in the model dtype.
"""

from __future__ import annotations

from typing import Any

from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from engine.interfaces.gemm import QuantizedWeight
from engine.interfaces.grouped_int import GROUPED_INT_BITS, grouped_int_codes, grouped_int_weight
from engine.loader.quantized import GGUF_SCHEME_PREFIX, make_gguf_weight


def weight_rows(weight: Any, rows: slice) -> Any:
    """Output rows ``rows`` (a unit-step slice) of a weight or a bias."""
    if not isinstance(weight, QuantizedWeight):
        return weight[rows]
    start, stop, _ = rows.indices(weight.shape[0])
    if (start, stop) == (0, weight.shape[0]):
        return weight
    if weight.scheme.startswith(GGUF_SCHEME_PREFIX):
        qtype = GGMLQuantizationType(weight.extra["ggml_type"])
        return make_gguf_weight(weight.data[start:stop].contiguous(), qtype, (stop - start, weight.shape[1]))
    if weight.scheme in GROUPED_INT_BITS:
        e = weight.extra
        return grouped_int_weight(
            grouped_int_codes(weight)[start:stop], e["scales"][start:stop], e["zeros"][start:stop],
            int(e["group_size"]), GROUPED_INT_BITS[weight.scheme], e.get("perm"),
        )  # fmt: skip
    return weight.dequantize()[start:stop]


def weight_columns(weight: Any, columns: slice) -> Any:
    """Input columns ``columns`` (a unit-step slice) of a matrix, in its storage where its blocks allow."""
    if not isinstance(weight, QuantizedWeight):
        return weight[:, columns]
    start, stop, _ = columns.indices(weight.shape[1])
    if (start, stop) == (0, weight.shape[1]):
        return weight
    if weight.scheme.startswith(GGUF_SCHEME_PREFIX):
        qtype = GGMLQuantizationType(weight.extra["ggml_type"])
        block_elements, block_bytes = GGML_QUANT_SIZES[qtype]
        if start % block_elements == 0 and stop % block_elements == 0:
            first, last = start // block_elements * block_bytes, stop // block_elements * block_bytes
            data = weight.data[:, first:last].contiguous()
            return make_gguf_weight(data, qtype, (weight.shape[0], stop - start))
    e = weight.extra
    if weight.scheme in GROUPED_INT_BITS and e.get("perm") is None:
        group = int(e["group_size"])
        if start % group == 0 and stop % group == 0:
            # whole groups of columns in input order: the codes' and the groups' own columns
            return grouped_int_weight(
                grouped_int_codes(weight)[:, start:stop], e["scales"][:, start // group : stop // group],
                e["zeros"][:, start // group : stop // group], group, GROUPED_INT_BITS[weight.scheme],
            )  # fmt: skip
    return weight.dequantize()[:, start:stop]


def dense(weight: Any) -> Any:
    """A quantized weight dequantized (float32); anything else unchanged."""
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight

"""The plugin API's layout for weight-only integer quantization with group-wise scales and zero points:
the form GPTQ, AWQ and compressed-tensors ``pack-quantized`` checkpoints are repacked into at load.

Schemes ``int4_grouped`` and ``int8_grouped`` (``QuantizedWeight.scheme``):

- ``data``: ``torch.uint8``; 4-bit: ``[out, in / 2]``, two codes a byte, the even column in the low nibble;
  8-bit: ``[out, in]``. Codes are unsigned (``0 .. 2**bits - 1``).
- ``extra["scales"]``: float32 ``[out, groups]``; ``extra["zeros"]``: float32 ``[out, groups]``, the zero
  point in code units (``2**(bits - 1)`` for a symmetric checkpoint); ``extra["group_size"]``: columns per
  group (``in`` for one group per row); ``groups = in / group_size``.
- ``extra["perm"]``: None, or int64 ``[in]`` (GPTQ's act-order): stored column ``j`` holds input feature
  ``perm[j]``, so that groups are runs of ``group_size`` stored columns. A GEMM computes
  ``x[:, perm] @ stored.T``.

Stored column ``j`` of row ``o`` is ``(code[o, j] - zeros[o, j // group_size]) * scales[o, j // group_size]``.
"""

from __future__ import annotations

import torch

from engine.interfaces.gemm import QuantizedWeight

INT4_GROUPED = "int4_grouped"
INT8_GROUPED = "int8_grouped"
#: scheme -> bits per code
GROUPED_INT_BITS = {INT4_GROUPED: 4, INT8_GROUPED: 8}


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes ``[rows, cols]`` (cols even) as bytes ``[rows, cols / 2]``, even column low."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 codes ``[rows, 2 * bytes]``."""
    return torch.stack([data & 0x0F, data >> 4], dim=-1).flatten(-2)


def grouped_int_codes(weight: QuantizedWeight) -> torch.Tensor:
    """A grouped-int weight's unsigned codes ``[out, in]`` in stored column order."""
    return unpack_int4(weight.data) if weight.scheme == INT4_GROUPED else weight.data


def dequantize_stored(weight: QuantizedWeight) -> torch.Tensor:
    """float32 ``[out, in]`` in *stored* column order (``perm`` not undone): what a kernel multiplies."""
    group = int(weight.extra["group_size"])
    codes = grouped_int_codes(weight).float()
    scales = weight.extra["scales"].float().repeat_interleave(group, dim=1)
    zeros = weight.extra["zeros"].float().repeat_interleave(group, dim=1)
    return (codes - zeros) * scales


def grouped_int_weight(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    perm: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Wrap unsigned codes and their group parameters as an ``int4_grouped`` / ``int8_grouped`` weight.

    Args:
        codes: ``[out, in]`` integer codes in stored column order.
        scales: ``[out, groups]``.
        zeros: ``[out, groups]`` zero points in code units.
        group_size: columns per group (``in`` for one group per row).
        bits: 4 or 8.
        perm: stored column ``j`` holds input feature ``perm[j]`` (None: identity).

    Returns:
        The weight, its ``dequantize`` giving float32 ``[out, in]`` in input-feature order.

    Raises:
        ValueError: unsupported bits, or shapes that do not belong together.
    """
    if bits not in (4, 8):
        raise ValueError(f"grouped integer weights are 4- or 8-bit, got {bits}")
    out_features, in_features = codes.shape
    if in_features % group_size or tuple(scales.shape) != (out_features, in_features // group_size):
        raise ValueError(
            f"scales {list(scales.shape)} do not match {out_features}x{in_features} codes in groups of {group_size}"
        )
    if tuple(zeros.shape) != tuple(scales.shape):
        raise ValueError(f"zero points {list(zeros.shape)} do not match scales {list(scales.shape)}")
    if perm is not None and tuple(perm.shape) != (in_features,):
        raise ValueError(f"column order of {list(perm.shape)} entries for {in_features} input features")
    scheme = INT4_GROUPED if bits == 4 else INT8_GROUPED
    data = pack_int4(codes) if bits == 4 else codes.to(torch.uint8).contiguous()
    extra = {
        "scales": scales.float().contiguous(), "zeros": zeros.float().contiguous(), "group_size": int(group_size),
        "perm": None if perm is None else perm.to(torch.int64),
    }  # fmt: skip
    weight = QuantizedWeight(scheme, data, (int(out_features), int(in_features)), None, extra)

    def dequantize() -> torch.Tensor:
        stored = dequantize_stored(weight)
        order = weight.extra["perm"]
        if order is None:
            return stored
        dense = torch.empty_like(stored)
        dense[:, order] = stored
        return dense

    weight.dequantize = dequantize
    return weight

"""FP8 e4m3 weights on a torch GPU through torch's scaled matmul (:class:`Fp8Weight`, :func:`fp8_linear`), for the
GEMM backend of :mod:`engine_plugin_sdk.gpu.gemm`.

FP8 activations are quantized per row on the fly in two terms, ``x = hi + lo`` with ``hi = fp8(x)`` and
``lo = fp8(x - hi)``, stacked along the rows of one scaled matmul, so the weight is read once (half the
bytes of bf16) while the activation rounding error becomes second order: a single FP8 term misses the
conformance tolerance by a wide margin on its own.

Checkpoints store the OCP ``float8_e4m3fn``. NVIDIA and CDNA4 (gfx950) multiply that format; MI300-class
GPUs (gfx94x) multiply ``float8_e4m3fnuz``. The two share their bit layout except for the exponent
bias (8 instead of 7) and the pattern ``0x80`` (negative zero in e4m3fn, NaN in fnuz), so a weight
converts exactly by reinterpreting its bits, clearing ``0x80`` and doubling the scale.

Weights the engine quantized itself at load (``quantization="fp8"``, marked
``extra["activations"] == "per_token"``) take one FP8 term per activation row instead: that is W8A8, the
matmul runs at the FP8 rate (about twice bf16's) rather than reading half the weight bytes only, and the
user asked for that trade of accuracy for speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.interfaces.gemm import RowQuantizedActivations
from engine.interfaces.ops import quantize_rows as reference_quantize_rows

FP8_SCHEME = "fp8_e4m3"
#: largest finite value of each e4m3 flavour
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0}
_NEGATIVE_ZERO_BITS = -128  # 0x80 as int8


@dataclass(slots=True)
class Fp8Weight:
    """An FP8 weight ready for ``torch._scaled_mm``.

    Attributes:
        data: ``[out, in]`` in the GPU's FP8 dtype, row-major (its transpose is the column-major operand).
        scale: float32 ``[1, out]`` per-channel scales (a per-tensor scale is broadcast to every channel).
        shape: ``(out_features, in_features)``.
        per_token_activations: quantize activations to a single FP8 term per row (W8A8) rather than
            the two-term split.
    """

    data: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, int]
    per_token_activations: bool = False


def e4m3fn_to_fnuz(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values as ``data * scale`` in e4m3fnuz: bits reinterpreted, ``0x80`` cleared, scale doubled."""
    bits = data.contiguous().view(torch.int8).clone()
    bits[bits == _NEGATIVE_ZERO_BITS] = 0
    return bits.view(torch.float8_e4m3fnuz), scale * 2.0


def fp8_shape_ok(shape: tuple[int, int]) -> bool:
    """Scaled matmul needs both dimensions to be multiples of 16."""
    return shape[0] % 16 == 0 and shape[1] % 16 == 0


def split_quantize_rows(x: torch.Tensor, fp8: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2M, K]`` FP8 rows (``hi`` then ``lo``) and their float32 ``[2M, 1]`` scales for ``x [M, K]``."""
    xf = x.float()
    hi, hi_scale = quantize_rows(xf, fp8)
    lo, lo_scale = quantize_rows(xf - hi.float() * hi_scale, fp8)
    return torch.cat([hi, lo]), torch.cat([hi_scale, lo_scale])


def quantize_rows(x: torch.Tensor, fp8: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """One FP8 term per row: ``[M, K]`` FP8 values and float32 ``[M, 1]`` scales (``max |row| / fp8 max``),
    as the core's reference producers quantize them."""
    rows = reference_quantize_rows(x, fp8)
    return rows.data, rows.scale


def fp8_linear(
    x: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None,
    quantize: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` with an FP8 weight (see the module docstring for the activations).

    Args:
        quantize: the single-term row quantizer for per-token weights (a fused kernel on the GPU);
            :func:`quantize_rows` when None.
    """
    out_features, in_features = weight.shape
    if isinstance(x, RowQuantizedActivations):
        if not weight.per_token_activations or x.data.dtype != weight.data.dtype:
            x = dequantize_rows(x)
        else:
            # quantized by the op that produced them: straight to the scaled matmul
            y = torch._scaled_mm(
                x.data, weight.data.t(), scale_a=x.scale, scale_b=weight.scale, out_dtype=_scaled_mm_dtype(x.data)
            )
            if bias is not None:
                y = y + bias.to(y.dtype)
            return y.to(x.dtype)
    rows = x.reshape(-1, in_features)
    m = rows.shape[0]
    quantizer = (quantize or quantize_rows) if weight.per_token_activations else split_quantize_rows
    # activations in the weight's flavour: scaled matmul takes one FP8 format for both operands
    quantized, scales = quantizer(rows, weight.data.dtype)
    y = torch._scaled_mm(quantized, weight.data.t(), scale_a=scales, scale_b=weight.scale, out_dtype=_scaled_mm_dtype(rows))
    if not weight.per_token_activations:
        # the two halves are summed in fp32
        y = y[:m].float() + y[m:].float()
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


def _scaled_mm_dtype(rows: torch.Tensor) -> torch.dtype:
    # cuBLAS's / hipBLASLt's row-wise scaled matmul writes bf16 only; the CPU path (tests) keeps fp32
    return torch.float32 if rows.device.type == "cpu" else torch.bfloat16


def dequantize_rows(x: RowQuantizedActivations) -> torch.Tensor:
    """The plain activations FP8 rows stand for, in their activation dtype (for a weight that cannot
    take them quantized)."""
    return (x.data.float() * x.scale).to(x.dtype)

"""Quantizing a float checkpoint's matrices to FP8 e4m3 as they load (``quantization="fp8"``).

Each output channel (row) gets its own scale, ``max |row| / 448``, so one large row does not flatten the
others. The weights are then ``fp8_e4m3`` :class:`QuantizedWeight` s like an FP8 checkpoint's, marked
``extra["activations"] = "per_token"``: the GEMM is asked to quantize activations to one FP8 term per
row as well (W8A8), which is what doubles the matmul rate. An FP8 checkpoint's weights carry the same mark
when its config quantizes activations too (:mod:`engine.loader.prequantized.config`); a weight-only FP8
checkpoint keeps the backend's more accurate default.
"""

from __future__ import annotations

import torch

from engine.interfaces.gemm import ACTIVATIONS_KEY, PER_TOKEN_ACTIVATIONS, QuantizedWeight

__all__ = ["ACTIVATIONS_KEY", "FP8_E4M3_MAX", "FP8_E4M3_SCHEME", "PER_TOKEN_ACTIVATIONS", "quantize_fp8_per_channel"]

FP8_E4M3_SCHEME = "fp8_e4m3"
#: largest finite float8_e4m3fn
FP8_E4M3_MAX = 448.0


def quantize_fp8_per_channel(weight: torch.Tensor) -> QuantizedWeight:
    """``weight [out, in]`` as an ``fp8_e4m3`` weight with per-output-channel float32 scales.

    Runs where ``weight`` is (the accelerator when the loader put it there). A row of zeros gets scale 1.

    Raises:
        ValueError: for a tensor that is not a 2-D float matrix.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"FP8 quantization takes a 2-D float matrix, got {weight.dtype} {tuple(weight.shape)}")
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    data = (w / scale[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    del w

    def dequantize() -> torch.Tensor:
        return data.float() * scale[:, None]

    return QuantizedWeight(
        scheme=FP8_E4M3_SCHEME,
        data=data,
        shape=(int(weight.shape[0]), int(weight.shape[1])),
        dequantize=dequantize,
        extra={"scale": scale, ACTIVATIONS_KEY: PER_TOKEN_ACTIVATIONS},
    )

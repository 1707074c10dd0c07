"""GEMM on ROCm: bf16 / fp16 / fp32 through torch (hipBLASLt), FP8 e4m3 weights through scaled matmul.

The implementation is the SDK's vendor-neutral :mod:`engine_plugin_sdk.gpu.gemm`: it already handles what is AMD's own, the ``float8_e4m3fnuz`` that MI300-class GPUs
(gfx94x) multiply, by converting checkpoint e4m3fn weights exactly (:func:`e4m3fn_to_fnuz`).
"""

from __future__ import annotations

from engine_plugin_sdk.gpu.fp8_gemm import FP8_MAX, FP8_SCHEME, Fp8Weight, e4m3fn_to_fnuz
from engine_plugin_sdk.gpu.gemm import TorchGemmBackend

# the helpers (fp8_linear, split_quantize_rows, ...) live in engine_plugin_sdk.gpu.fp8_gemm
__all__ = ["FP8_MAX", "FP8_SCHEME", "Fp8Weight", "RocmGemmBackend", "e4m3fn_to_fnuz"]


class RocmGemmBackend(TorchGemmBackend):
    """``torch.nn.functional.linear`` on the GPU; FP8 e4m3 weights stay FP8 on GPUs with FP8 matrix cores.

    Args:
        device: where weights go.
        fp8_dtype: the GPU's FP8 dtype name (``"float8_e4m3fnuz"`` on MI300, ``"float8_e4m3fn"`` on
            MI350), or None: ``fp8_e4m3`` weights are then dequantized at load like every other scheme.

    Raises:
        ValueError: for an FP8 dtype name that is not an e4m3 flavour.
    """

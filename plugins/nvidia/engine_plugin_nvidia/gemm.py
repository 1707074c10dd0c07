"""GEMM on NVIDIA GPUs: bf16 / fp16 / fp32 through torch (cuBLAS), FP8 e4m3 weights through torch's scaled matmul.

The implementation, including the two-term FP8 activations, is :mod:`engine_plugin_nvidia.gpu_common.gemm`
(shared with the ROCm plugin). NVIDIA's FP8 tensor cores (Ada / Hopper and later) multiply the OCP
``float8_e4m3fn`` that checkpoints store, so weights load without conversion.
"""

from __future__ import annotations

from typing import Any

from engine_plugin_nvidia.gpu_common import gemm as _common
from engine_plugin_nvidia.gpu_common.gemm import FP8_SCHEME, Fp8Weight, TorchGemmBackend, to_torch_dtype

# the helpers (fp8_linear, split_quantize_rows, ...) live in engine_plugin_nvidia.gpu_common.gemm
__all__ = ["FP8_MAX", "FP8_SCHEME", "CudaGemmBackend", "Fp8Weight", "to_torch_dtype"]

#: the FP8 dtype NVIDIA's tensor cores take
FP8_DTYPE = "float8_e4m3fn"
#: largest finite e4m3fn value
FP8_MAX = _common.FP8_MAX[FP8_DTYPE]


class CudaGemmBackend(TorchGemmBackend):
    """``torch.nn.functional.linear`` on the GPU; FP8 e4m3 weights stay FP8 where the GPU has FP8 units.

    Args:
        device: where weights go.
        fp8: keep ``fp8_e4m3`` weights in FP8 (True on Ada / Hopper and later); otherwise they are
            dequantized at load like every other scheme.
        fp8_dtype: the shared backends' spelling of ``fp8=True`` (what the platform passes); only
            ``"float8_e4m3fn"`` runs on NVIDIA.

    Raises:
        ValueError: for an ``fp8_dtype`` other than ``"float8_e4m3fn"``.
    """

    def __init__(self, device: Any, fp8: bool = False, fp8_dtype: str | None = None) -> None:
        if fp8_dtype not in (None, FP8_DTYPE):
            raise ValueError(f"fp8_dtype must be {FP8_DTYPE!r} or None on NVIDIA, got {fp8_dtype!r}")
        super().__init__(device, fp8_dtype=FP8_DTYPE if fp8 or fp8_dtype else None)

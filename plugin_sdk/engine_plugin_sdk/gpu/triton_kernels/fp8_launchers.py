"""Launchers of the FP8 producer ops: a norm or the SwiGLU product writing a W8A8 GEMM's input directly
(one FP8 term per row and its scale), so that the GEMM needs no quantizing pass of its own.

They return :class:`~engine.interfaces.gemm.RowQuantizedActivations` of the activations' dtype. Triton's
interpreter converts to FP8 wrongly, so the platform offers these only on GPUs with FP8 units.
"""

from __future__ import annotations

import torch

from engine.interfaces.gemm import RowQuantizedActivations
from engine_plugin_sdk.gpu.triton_kernels import elementwise_kernels as ek
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.launch import next_power_of_2
from engine_plugin_sdk.gpu.triton_kernels.launchers import empty_fp8_rows, rows_of


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fp8_dtype: torch.dtype
) -> tuple[RowQuantizedActivations, torch.Tensor]:
    """``(FP8 rows of rms_norm(x + residual), x + residual)`` in one pass.

    Raises:
        ValueError: for an FP8 dtype other than the two e4m3 flavours.
    """
    rows, res = rows_of(x), rows_of(residual)
    m, hidden = rows.shape
    limit, out, scale = empty_fp8_rows(m, hidden, fp8_dtype, x.device)
    res_out = torch.empty_like(res)
    if m:
        block = next_power_of_2(hidden)
        ek.fused_add_rms_norm_fp8_kernel[(m,)](
            out, scale, res_out, rows, res, weight, eps,
            rows.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            HIDDEN=hidden, BLOCK=block, FP8_MAX=limit, num_warps=min(8, max(1, block // 256)),
            **pdl.launch_options(),
        )  # fmt: skip
    return RowQuantizedActivations(out, scale, x.dtype), res_out.view(residual.shape)


def silu_and_mul_fp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> RowQuantizedActivations:
    """FP8 rows of ``silu(x[:, :d]) * x[:, d:]``, one program per whole row (the scale needs its max).

    Raises:
        ValueError: for an FP8 dtype other than the two e4m3 flavours.
    """
    rows = rows_of(x)
    m, d = rows.shape[0], rows.shape[1] // 2
    limit, out, scale = empty_fp8_rows(m, d, fp8_dtype, x.device)
    if m:
        block = next_power_of_2(d)
        ek.silu_and_mul_fp8_kernel[(m,)](
            out, scale, rows, rows.stride(0), out.stride(0),
            D=d, BLOCK=block, FP8_MAX=limit, num_warps=min(16, max(1, block // 512)), **pdl.launch_options(),
        )  # fmt: skip
    return RowQuantizedActivations(out, scale, x.dtype)

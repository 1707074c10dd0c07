"""Launchers of the single-row GEMVs (batch-1 decode): the plain product, the gated MLP's fused gate/up product
with its activation, and a router's product with the residual norm before it."""

from __future__ import annotations

import torch

from engine_plugin_sdk.gpu.triton_kernels import elementwise_kernels as ek
from engine_plugin_sdk.gpu.triton_kernels import gemv_kernels as gk
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.l2_prefetch import l2_share_args
from engine_plugin_sdk.gpu.triton_kernels.launch import next_power_of_2

#: the gated GEMV's ``ACT`` by the activation names of ``GemmBackend.gated_linear``
GATED_ACTIVATIONS = {"silu": ek.SILU, "gelu_tanh": ek.GELU_TANH}


def _single_row(x: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    # the one row of x as a contiguous [k] vector, after the checks both GEMVs share
    if x.numel() != k:
        raise ValueError(f"gemv takes one row of {k} values, got x of shape {tuple(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs a weight with contiguous rows")
    flat = x.reshape(k)
    return flat if flat.stride(0) == 1 else flat.contiguous()


def _prefetch(tiles: int, k: int, block_k: int) -> dict:
    # weight tiles a program loads before its PDL wait (1 to 4): no more than the row holds
    return {"PREFETCH": max(1, min(tiles, 4, k // block_k))}


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    block_n: int = 16, block_k: int = 256, num_warps: int = 4, num_stages: int = 3,
    out_dtype: torch.dtype | None = None, prefetch: int = 1,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a single row ``x`` ``[1, K]`` (or ``[K]``) and ``weight`` ``[N, K]``,
    in ``out_dtype`` (default: x's; float32 stores the accumulator unrounded, as logits want).

    Raises:
        ValueError: for more than one row, mismatched widths or a weight whose rows are not contiguous.
    """
    n, k = weight.shape
    flat = _single_row(x, weight, k)
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias has {bias.numel()} values for {n} outputs")
    y = torch.empty(n, dtype=out_dtype or x.dtype, device=x.device)
    gk.gemv_kernel[(-(-n // block_n),)](
        flat, weight, bias if bias is not None else y, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=num_warps, num_stages=num_stages, **_prefetch(prefetch, k, block_k), **pdl.launch_options(),
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)


def gated_gemv(
    x: torch.Tensor, weight: torch.Tensor, activation: str,
    block_n: int = 4, block_k: int = 1024, num_warps: int = 4, num_stages: int = 2, prefetch: int = 1,
) -> torch.Tensor:
    """``act(x @ G.T) * (x @ U.T)`` for a single row ``x`` ``[1, K]`` (or ``[K]``) and ``weight``
    ``[2 * d, K]`` stacking the gate's rows ``G`` over the up rows ``U``; ``[..., d]`` in x's dtype.

    Raises:
        ValueError: for more than one row, mismatched widths, an odd row count, a weight whose rows are
            not contiguous, or an unknown activation.
    """
    act = GATED_ACTIVATIONS.get(activation)
    if act is None:
        raise ValueError(f"unknown gated activation {activation!r} (known: {sorted(GATED_ACTIVATIONS)})")
    rows, k = weight.shape
    if rows % 2:
        raise ValueError(f"a gated weight stacks gate and up rows: {rows} rows is odd")
    flat = _single_row(x, weight, k)
    d = rows // 2
    y = torch.empty(d, dtype=x.dtype, device=x.device)
    gk.gated_gemv_kernel[(-(-d // block_n),)](
        flat, weight, y, d, k, weight.stride(0),
        ACT=act, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=num_warps, num_stages=num_stages, **_prefetch(prefetch, k, block_k), **pdl.launch_options(),
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], d)


def add_rms_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None = None, block_n: int = 4, block_k: int = 1024, num_warps: int = 4,
    num_stages: int = 2, prefetch: int = 1, l2_ahead: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(n @ weight.T (+ bias), n, s)`` for a single row: ``s = x + residual`` and ``n = rms_norm(s) *
    norm_weight`` as ``fused_add_rms_norm`` computes them (``GemmBackend.add_rms_norm_router``), all in x's dtype.
    ``l2_ahead``: a contiguous tensor whose bytes the programs ask the L2 cache for past their wait (an experiment:
    ``benchmarks/nvidia_l2_window.py``); None asks nothing.

    Raises:
        ValueError: for more than one row, mismatched widths or a weight whose rows are not contiguous.
    """
    n, k = weight.shape
    flat = _single_row(x, weight, k)
    res = _single_row(residual, weight, k)
    if norm_weight.numel() != k or (bias is not None and bias.numel() != n):
        raise ValueError(f"norm weight of {norm_weight.numel()} or bias of {bias.numel() if bias is not None else 0} "
                         f"values for a {n} x {k} product")  # fmt: skip
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    normed, summed = torch.empty_like(flat), torch.empty_like(flat)
    programs = -(-n // block_n)
    gk.add_rms_norm_gemv_kernel[(programs,)](
        flat, res, norm_weight.contiguous(), weight, bias if bias is not None else y, y, normed, summed, eps,
        n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, ROW=next_power_of_2(k),
        num_warps=num_warps, num_stages=num_stages, **_prefetch(prefetch, k, block_k),
        **l2_share_args(l2_ahead, programs, x.is_cuda), **pdl.launch_options(),
    )  # fmt: skip
    shape = x.shape[:-1]
    return y.reshape(*shape, n), normed.reshape(*shape, k), summed.reshape(*shape, k)

"""Host side of a layer's residual add and RMS norm taken by the one-row integer-dot GEMV after it
(``GemmBackend.add_rms_norm_linear``): inside the programs of a single-step GEMV (``dot_gemv_residual_norm``,
:mod:`.grouped_int_dot_norm`), or in a norm kernel that hands the GEMV its row already converted
(``dot_gemv_prepared``, :mod:`.grouped_int_dot_prepared`)."""

from __future__ import annotations

import torch
import triton

from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_dot_prepared as prepared_kernels
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_gemv_rows as gated_rows
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import dot_gemv, dot_rows, takes_dot
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import GroupedIntTiles
from engine_plugin_sdk.gpu.triton_kernels.launchers import row_warps

#: the widest row the prepared row's norm program takes (a row in one program, as the norm kernel's)
MAX_PREPARED_COLUMNS = 16384


def grouped_int_add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: GroupedIntWeight,
    bias: torch.Tensor | None,
    tiles: GroupedIntTiles,
    gated: int = gated_rows.NOT_GATED,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(linear(rms_norm(x + residual) * norm_weight), x + residual)`` by the integer-dot GEMV (with ``gated``, its
    gated product): in one launch with ``tiles.dot_gemv_residual_norm`` (a single-step product), else with
    ``tiles.dot_gemv_prepared`` a norm kernel that converts the row for it (at most ``MAX_PREPARED_COLUMNS``),
    then the GEMV; None where that kernel does not take them: more than one row, a longer reduction, a
    permutation, 6-bit codes, or inputs that are not 16-bit, contiguous and 4-byte aligned (the caller then runs
    the norm and the product).

    Args:
        x: ``[1, K]`` (or ``[K]``) branch output.
        residual: the residual stream, ``x``'s shape and dtype.
        norm_weight: ``[K]`` in ``x``'s dtype.
        eps: the norm's epsilon.
        weight: from :func:`pack_grouped_int`.
        bias: ``[out_features]`` or None (none when gated).
        tiles: launch parameters (``dot_gemv_residual_norm`` or ``dot_gemv_prepared`` set).
        gated: :data:`.elementwise_kernels.SILU` or ``GELU_TANH`` for the gated product, else not gated.

    Returns:
        The product (``[..., N]`` or ``[..., N / 2]`` gated) and the sum, in ``x``'s shape, or None.
    """
    out_features, in_features = weight.shape
    parts = (x, residual, norm_weight)
    slots = in_features // (16 if weight.bits == 8 else 32)
    fits = (
        (tiles.dot_gemv_residual_norm or tiles.dot_gemv_prepared)
        and x.numel() == in_features == residual.numel() == norm_weight.numel()
        and x.dtype == residual.dtype == norm_weight.dtype
        and all(t.is_contiguous() and t.data_ptr() % 4 == 0 for t in parts)
        and weight.bits in (4, 8)
        and weight.perm is None
        # the norm in the GEMV's programs: one step; the prepared row: one norm program
        and (slots <= 32 * tiles.dot_gemv_warps if tiles.dot_gemv_residual_norm else in_features <= MAX_PREPARED_COLUMNS)
        and tiles.dot_gemv_row_groups == 1
        and (gated == gated_rows.NOT_GATED or (out_features % 2 == 0 and dot_rows(weight, tiles) % 2 == 0))
    )
    if not fits or not takes_dot(x.reshape(1, in_features), weight, tiles):
        return None
    row = x.reshape(1, in_features)
    width = out_features if gated == gated_rows.NOT_GATED else out_features // 2
    out = torch.empty((1, width), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(residual)
    if tiles.dot_gemv_residual_norm:
        # every program of the GEMV adds and normalises the row itself; the first stores the sum
        norm = {"NORM": True, "res_ptr": residual, "nw_ptr": norm_weight, "res_out_ptr": summed, "eps": float(eps)}
        dot_gemv(row, weight, bias, tiles, out, gated, norm)
    else:
        converted, unit, total = prepare_row(row, residual, norm_weight, eps, weight, summed)
        dot_gemv(converted, weight, bias, tiles, out, gated, {"PREPARED": True, "unit_ptr": unit, "total_ptr": total})
    return out.reshape(*x.shape[:-1], width), summed


def prepare_row(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: GroupedIntWeight,
    summed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row's residual add and RMS norm converted for the integer-dot GEMV over ``weight``
    (:mod:`.grouped_int_dot_prepared`); ``summed`` receives ``x + residual``.

    Args:
        x: ``[1, K]`` branch output, 16-bit, contiguous.
        residual: the residual stream, ``[K]`` elements in ``x``'s dtype.
        norm_weight: ``[K]`` in ``x``'s dtype.
        eps: the norm's epsilon.
        weight: 4- or 8-bit codes (its ``block_k`` and ``bits`` place the slots), ``K`` at most
            ``MAX_PREPARED_COLUMNS``.
        summed: ``residual``'s shape and dtype, written.

    Returns:
        ``(int16 [1, K] activations, float32 unit a slot, float32 activation sum a slot)``.
    """
    in_features = x.shape[-1]
    slots = in_features // (16 if weight.bits == 8 else 32)
    converted = torch.empty((1, in_features), dtype=torch.int16, device=x.device)
    unit = torch.empty(slots, dtype=torch.float32, device=x.device)
    total = torch.empty(slots, dtype=torch.float32, device=x.device)
    # the norm kernel's layout and warps: its sum of squares, so its normalised row, bit for bit
    cols = triton.next_power_of_2(in_features)
    prepared_kernels.add_rms_norm_prepared_kernel[(1,)](
        x, residual, norm_weight, summed, converted, unit, total, float(eps),
        HIDDEN=in_features, COLS=cols, BLOCK=weight.block_k, BITS=weight.bits, num_warps=row_warps(cols),
        **pdl.launch_options(),
    )  # fmt: skip
    return converted, unit, total

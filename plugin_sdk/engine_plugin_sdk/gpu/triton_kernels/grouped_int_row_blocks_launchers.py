"""Host side of a joined projection's product (:class:`~engine_plugin_sdk.gpu.gemm.GroupedIntRowBlocks`): one launch
of :mod:`.grouped_int_dot_row_blocks` at one row where both blocks take the integer-dot GEMV alike, else each
block's own product into its columns of the one output."""

from __future__ import annotations

import torch
import triton

from engine_plugin_sdk.gpu.gemm import GroupedIntRowBlocks, GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_dot_row_blocks as blocks_kernels
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import (
    dot_form,
    dot_operands,
    dot_rows,
    grouped_int_linear,
    register_cap,
    takes_dot,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import GroupedIntTiles

#: :func:`.grouped_int_launchers.dot_operands`' per-weight arguments by the blocks kernel's names (suffixed ``_a`` /
#: ``_b``, the constants ``_A`` / ``_B``)
_BLOCK_ARGS = {
    "w_ptr": "w", "scale_ptr": "scale", "zs_ptr": "zs", "super_ptr": "super", "zsuper_ptr": "zsuper",
    "plane_ptr": "plane", "stride_wn": "stride_wn", "stride_sn": "stride_sn", "stride_pn": "stride_pn",
    "NUM_SLOTS": "SLOTS", "GROUP": "GROUP", "ZERO": "ZERO", "HAS_ZS": "HAS_ZS", "BLOCK": "BLOCK", "BITS": "BITS",
    "AHEAD": "AHEAD", "SUB_GROUPS": "SUB_GROUPS", "EARLY_PARAMS": "EARLY", "PARAM_ROWS": "PARAM_ROWS",
}  # fmt: skip


def row_blocks_linear(
    x: torch.Tensor,
    weight: GroupedIntRowBlocks,
    bias: torch.Tensor | None,
    tiles: GroupedIntTiles,
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` the blocks stacked.

    Args:
        x: ``[..., in_features]`` activations.
        weight: the joined blocks.
        bias: ``[out_features]`` of the stacked projection, or None.
        tiles: launch parameters.

    Returns:
        ``[..., out_features]`` in ``x``'s dtype.

    Raises:
        ValueError: when ``x``'s last dimension is not the weight's ``in_features``.
    """
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"activations of width {x.shape[-1]} for a weight of {in_features} input features")
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], out_features), dtype=x.dtype, device=x.device)
    if one_launch(rows, weight, tiles):
        _blocks_gemv(rows, weight, bias, tiles, out)
    else:
        start = 0
        biases = bias.split(list(weight.rows)) if bias is not None else [None] * len(weight.parts)
        for part, n, b in zip(weight.parts, weight.rows, biases, strict=True):
            out[:, start : start + n] = grouped_int_linear(rows, part, b, tiles)
            start += n
    return out.reshape(*x.shape[:-1], out_features)


def one_launch(rows: torch.Tensor, weight: GroupedIntRowBlocks, tiles: GroupedIntTiles) -> bool:
    """Whether one launch of the integer-dot GEMV takes ``rows`` through both blocks: one row of 16-bit activations
    (:func:`.grouped_int_launchers.takes_dot`) through blocks that :func:`joinable` holds for."""
    return rows.shape[0] == 1 and takes_dot(rows, weight.parts[0], tiles) and joinable(weight.parts, weight.rows, tiles)


def joinable(parts: tuple[GroupedIntWeight, ...], rows: tuple[int, ...], tiles: GroupedIntTiles) -> bool:
    """Whether one launch takes a row through blocks ``parts`` of ``rows`` rows each: asked for
    (``dot_gemv_row_blocks``), two blocks whose forms the integer-dot GEMV takes at the same rows a program in
    one row group, without a permutation, the first block's rows whole programs."""
    if not tiles.dot_gemv_row_blocks or len(parts) != 2 or tiles.dot_gemv_row_groups != 1:
        return False
    per_program = dot_rows(parts[0], tiles)
    return (
        all(dot_form(part, tiles) and part.perm is None for part in parts)
        and dot_rows(parts[1], tiles) == per_program
        and rows[0] % per_program == 0
    )


def _blocks_gemv(
    row: torch.Tensor, weight: GroupedIntRowBlocks, bias: torch.Tensor | None, tiles: GroupedIntTiles, out: torch.Tensor
) -> None:
    """One row through both blocks in one launch (:func:`one_launch` holds)."""
    per_program = dot_rows(weight.parts[0], tiles)
    operands = {}
    for suffix, part in zip(("_a", "_b"), weight.parts, strict=True):
        for key, value in dot_operands(part, tiles, per_program).items():
            name = _BLOCK_ARGS[key]
            # the constants' names are upper case, their suffixes too
            operands[name + (suffix.upper() if name.isupper() else suffix)] = value
    blocks_kernels.grouped_int_dot_gemv_blocks_kernel[(triton.cdiv(weight.shape[0], per_program),)](
        x_ptr=row, bias_ptr=bias.contiguous() if bias is not None else row, out_ptr=out, N=weight.shape[0],
        SPLIT=weight.rows[0], ROWS=per_program, WARPS=tiles.dot_gemv_warps, HAS_BIAS=bias is not None,
        FP16=row.dtype == torch.float16, ASM=tiles.mma_asm, PREFETCH_PARAMS=tiles.dot_gemv_prefetch_params,
        VECTOR_MASKS=tiles.dot_gemv_vector_masks, num_warps=tiles.dot_gemv_warps, num_stages=1, **operands,
        **pdl.launch_options(), **register_cap(tiles),
    )  # fmt: skip

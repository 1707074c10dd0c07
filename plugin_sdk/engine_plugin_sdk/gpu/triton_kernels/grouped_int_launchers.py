"""Host side of the grouped-integer weight-only GEMM and GEMVs (:mod:`.grouped_int_kernels`, :mod:`.grouped_int_gemm_kernels`,
:mod:`.grouped_int4_gemv_kernels`, :mod:`.grouped_int_dot_gemv_kernels`): grids, and the choice of a kernel by
the number of activation rows (the load-time repacking is in :mod:`.grouped_int_packing`, the few-row
tensor-core kernels' launchers and the split-K sums in :mod:`.grouped_int4_few_rows_launchers`, the launch
parameters in :mod:`.grouped_int_tiles`)."""

from __future__ import annotations

import torch
import triton

from engine_plugin_sdk.gpu.attention import stream_capturing
from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels import grouped_int4_gemv_kernels as g4
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_dot_gemv_kernels as dot
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_gemm_kernels as gemm_kernels
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_gemv_rows as gated_rows
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_kernels as gk
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.grouped_int4_few_rows_launchers import (
    fragment_fits,
    fragment_linear,
    mma_fits,
    mma_linear,
    split_result,
    split_target,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_params import super_args
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_program_params import program_params
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import GroupedIntTiles


def dequantize_grouped(weight: GroupedIntWeight, dtype: torch.dtype, block_n: int = 32) -> torch.Tensor:
    """``[out, in]`` in ``dtype`` of a packed weight in stored column order, on its device (by a kernel).

    Args:
        weight: from :func:`pack_grouped_int`.
        dtype: the copy's dtype (the activations').
        block_n: rows per program.

    Returns:
        A new contiguous tensor.
    """
    out_features, in_features = weight.shape
    out = torch.empty((out_features, in_features), dtype=dtype, device=weight.codes.device)
    scales = weight.scales
    gemm_kernels.grouped_int_dequant_kernel[(triton.cdiv(out_features, block_n), in_features // weight.block_k)](
        weight.codes, scales, weight.zero_scales if weight.zero_scales is not None else scales, out,
        out_features, weight.codes.stride(0), scales.stride(0), out.stride(0),
        GROUP=weight.group_size, BITS=weight.bits, ZERO=weight.zero_point, HAS_ZS=weight.zero_scales is not None,
        BLOCK=weight.block_k, BLOCK_N=block_n, **super_args(weight), **plane_args(weight),
    )  # fmt: skip
    return out


def plane_args(weight: GroupedIntWeight) -> dict:
    """A launch's arguments for a 6-bit weight's plane of high bits (for other weights its codes, unread: always a
    tensor, so that no launch specializes on a missing one)."""
    plane = weight.high_bits if weight.high_bits is not None else weight.codes
    return {"plane_ptr": plane, "stride_pn": plane.stride(0)}


def grouped_int_linear(
    x: torch.Tensor,
    weight: GroupedIntWeight,
    bias: torch.Tensor | None,
    tiles: GroupedIntTiles,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x[..., perm] @ dequant(W).T + bias``: one row through the GEMV, more through the GEMM (plus a sum
    over splits of its reduction).

    Args:
        x: ``[..., in_features]`` activations (float32 / float16 / bfloat16).
        weight: from :func:`pack_grouped_int`.
        bias: ``[out_features]`` or None.
        tiles: launch parameters (``tiles.block_k`` is not read: the weight's own was fixed at load).
        out_dtype: the result's dtype; ``x``'s when None (the logits ask for float32).

    Returns:
        ``[..., out_features]`` in ``out_dtype``.

    Raises:
        ValueError: when ``x``'s last dimension is not the weight's ``in_features``.
    """
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"activations of width {x.shape[-1]} for a weight of {in_features} input features")
    dtype = out_dtype or x.dtype
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if 0 < tiles.dense_rows <= m and dtype == rows.dtype:
        if weight.perm is not None:
            rows = rows.index_select(1, weight.perm)
        dense = torch.nn.functional.linear(rows, dequantize_grouped(weight, rows.dtype), bias)
        return dense.reshape(*x.shape[:-1], out_features)
    out = torch.empty((m, out_features), dtype=dtype, device=x.device)
    if 1 < m <= tiles.dot_gemv_x_rows and takes_dot(rows, weight, tiles):
        dot_gemv(rows, weight, bias, tiles, out)
    elif tiles.takes_fragments(m, out_features) and fragment_fits(rows, weight, tiles):
        fragment_linear(rows, weight, bias, tiles, out)
    elif m == 1:
        _gemv(rows, weight, bias, tiles, out)
    elif m <= tiles.mma_rows and mma_fits(rows, weight, tiles):
        out = mma_linear(rows, weight, bias, tiles, out)
    elif m > 0:
        out = _gemm(rows, weight, bias, tiles, out)
    return out.reshape(*x.shape[:-1], out_features)


def grouped_int_gated_linear(
    x: torch.Tensor, weight: GroupedIntWeight, activation: int, tiles: GroupedIntTiles
) -> torch.Tensor | None:
    """``act(x @ G.T) * (x @ U.T)`` of a weight stacking the gate's rows ``G`` over the up rows ``U``, in one
    launch of the fragment kernel or a GEMV where they take ``x``'s rows (else None: the caller runs the
    product, then the activation).

    Args:
        x: ``[..., in_features]`` activations.
        weight: from :func:`pack_grouped_int`, an even number of output features.
        activation: :data:`.elementwise_kernels.SILU` or ``GELU_TANH``.
        tiles: launch parameters.

    Returns:
        ``[..., out_features / 2]`` in ``x``'s dtype, or None.
    """
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    if out_features % 2 or x.shape[-1] != in_features:
        return None
    m = rows.shape[0]
    fragments = tiles.gated_epilogue and tiles.takes_fragments(m, out_features) and fragment_fits(rows, weight, tiles)
    if m <= max(1, tiles.dot_gemv_x_rows) and takes_dot(rows, weight, tiles):
        # the integer-dot GEMV pairs gate and up rows within a program of an even number of rows
        gemv = tiles.gated_epilogue and dot_rows(weight, tiles, m) % 2 == 0
        # several rows within dot_gemv_x_rows go to it before the fragment kernel (one row keeps the fragment
        # kernel where the tiles give it one row)
        fragments = fragments and not (gemv and m > 1)
    else:
        gemv = tiles.gemv_gated_epilogue and m == 1 and _gemv_tile(weight, tiles)[0] == 4 and weight.bits != 6
    if not (fragments or gemv):
        return None
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((m, out_features // 2), dtype=x.dtype, device=x.device)
    if fragments:
        fragment_linear(rows, weight, None, tiles, out, activation)
    else:
        _gemv(rows, weight, None, tiles, out, activation)
    return out.reshape(*x.shape[:-1], out_features // 2)


def gemv_subs(weight: GroupedIntWeight, row_bytes: int) -> int:
    """Sub-blocks of ``weight.block_k`` columns the GEMV reads per iteration: ``row_bytes`` of codes of a
    row, a power of two, no more than the row holds."""
    block_bytes = weight.block_k // 2 if weight.bits == 4 else weight.block_k
    blocks = weight.shape[1] // weight.block_k
    return max(1, min(triton.next_power_of_2(max(1, row_bytes // block_bytes)), triton.next_power_of_2(blocks)))


def _takes_words(weight: GroupedIntWeight, tiles: GroupedIntTiles) -> bool:
    """Whether one row with ``weight`` takes the word GEMV (4-bit codes in wide blocks, one-level scales), not the
    byte GEMV."""
    return weight.bits == 4 and weight.block_k >= tiles.gemv4_min_block and not weight.sub_groups


def takes_dot(row: torch.Tensor, weight: GroupedIntWeight, tiles: GroupedIntTiles) -> bool:
    """Whether the rows ``row`` with ``weight`` take the integer-dot GEMV: :func:`dot_form` against 16-bit
    activations whose pairs it reads as aligned 32-bit words."""
    aligned = row.data_ptr() % 4 == 0 and (row.shape[0] == 1 or row.stride(0) % 2 == 0)
    return row.dtype in (torch.bfloat16, torch.float16) and aligned and dot_form(weight, tiles)


def dot_form(weight: GroupedIntWeight, tiles: GroupedIntTiles) -> bool:
    """Whether the integer-dot GEMV takes ``weight``'s form: 4- and 6-bit codes (or, with ``tiles.dot_gemv_8bit``,
    8-bit codes in groups of a multiple of 16 columns) whose words it reads as aligned 16-byte vectors (a 6-bit
    plane's as 8-byte ones)."""
    eight = tiles.dot_gemv_8bit and weight.bits == 8 and weight.group_size % 16 == 0
    plane = weight.high_bits
    return (
        tiles.dot_gemv_rows > 0
        and (weight.bits in (4, 6) or eight)
        and weight.codes.data_ptr() % 16 == 0
        and weight.codes.stride(0) % 16 == 0
        and (plane is None or (plane.data_ptr() % 8 == 0 and plane.stride(0) % 8 == 0))
    )


def _dot_ahead(weight: GroupedIntWeight, tiles: GroupedIntTiles) -> bool:
    """Whether the integer-dot GEMV reads a step's operands ahead for ``weight`` (``dot_gemv_ahead`` for 4-bit
    codes with one zero point, ``dot_gemv_ahead_all`` for zero scales and 8-bit codes too)."""
    if tiles.dot_gemv_ahead_all:
        return True
    return tiles.dot_gemv_ahead and weight.bits == 4 and weight.zero_scales is None


def _dot_early_params(weight: GroupedIntWeight, tiles: GroupedIntTiles) -> bool:
    """Whether the integer-dot GEMV reads its first step's group parameters for ``weight`` before its PDL wait
    (``dot_gemv_early_zero_point_params`` for 4-bit codes with one zero point, ``dot_gemv_early_params`` else)."""
    if weight.bits == 4 and weight.zero_scales is None:
        return tiles.dot_gemv_early_zero_point_params
    return tiles.dot_gemv_early_params


def dot_rows(weight: GroupedIntWeight, tiles: GroupedIntTiles, x_rows: int = 1) -> int:
    """Rows a program of the integer-dot GEMV for ``weight`` at ``x_rows`` activation rows (6-bit codes and
    several activation rows may take their own)."""
    if weight.bits == 6 and tiles.dot_gemv_six_bit_rows:
        return tiles.dot_gemv_six_bit_rows
    if x_rows > 1 and tiles.dot_gemv_x_rows_rows:
        return tiles.dot_gemv_x_rows_rows
    if tiles.dot_gemv_narrow_rows and weight.shape[0] <= tiles.dot_gemv_narrow_max:
        return tiles.dot_gemv_narrow_rows
    return tiles.dot_gemv_rows


def _program_params(weight: GroupedIntWeight, tiles: GroupedIntTiles, rows: int, groups: int, gated: int):
    """The program-order copy of ``weight``'s parameters the integer-dot GEMV reads (``dot_gemv_program_params``
    for zero scales and 8- or 6-bit codes, ``dot_gemv_program_params_zero_point`` for 4-bit codes with one zero point),
    or None: not asked for, row groups, or a first use inside graph capture (the copy is made by the warm-up's
    eager steps; a captured product keeps the row-major parameters)."""
    one_zero = weight.bits == 4 and weight.zero_scales is None
    wanted = tiles.dot_gemv_program_params_zero_point if one_zero else tiles.dot_gemv_program_params
    if not wanted or groups != 1:
        return None
    key = (rows, gated != gated_rows.NOT_GATED)
    if key not in weight.program_params and stream_capturing():
        return None
    return program_params(weight, *key)


def register_cap(tiles: GroupedIntTiles) -> dict:
    """The integer-dot GEMV's launch option capping its registers a thread (none where the tiles set no cap)."""
    return {"maxnreg": tiles.dot_gemv_max_registers} if tiles.dot_gemv_max_registers else {}


def dot_operands(weight: GroupedIntWeight, tiles: GroupedIntTiles, rows: int, groups: int = 1,
                 gated: int = gated_rows.NOT_GATED, program_params: bool = True) -> dict:  # fmt: skip
    """``weight``'s arguments to the integer-dot GEMV at ``rows`` rows a program in ``groups`` row groups: its
    codes, group parameters (or, unless ``program_params`` is off, their program-order copy), super-block scales
    and plane with their strides, and its form's constants."""
    params = _program_params(weight, tiles, rows, groups, gated) if program_params else None
    scales, zero_scales, supers = weight.scales, weight.zero_scales, super_args(weight)
    if params is not None:
        scales, zero_scales = params.scales, params.zero_scales
        if weight.sub_groups:
            zsuper = params.super_zero_scales if params.super_zero_scales is not None else params.super_scales
            supers = {**supers, "super_ptr": params.super_scales, "zsuper_ptr": zsuper}
    return {
        "w_ptr": weight.codes, "scale_ptr": scales,
        # any pointer where there are none: unread without HAS_ZS
        "zs_ptr": zero_scales if zero_scales is not None else weight.scales,
        "stride_wn": weight.codes.stride(0), "stride_sn": params.stride if params is not None else weight.scales.stride(0),
        **supers, **plane_args(weight),
        "NUM_SLOTS": weight.shape[1] // (16 if weight.bits == 8 else 32), "GROUP": weight.group_size,
        "ZERO": weight.zero_point, "HAS_ZS": weight.zero_scales is not None, "BLOCK": weight.block_k,
        "BITS": weight.bits, "AHEAD": _dot_ahead(weight, tiles), "EARLY_PARAMS": _dot_early_params(weight, tiles),
        "PARAM_ROWS": rows if params is not None else 0,
    }  # fmt: skip


def dot_gemv(
    row: torch.Tensor,
    weight: GroupedIntWeight,
    bias: torch.Tensor | None,
    tiles: GroupedIntTiles,
    out: torch.Tensor,
    gated: int = gated_rows.NOT_GATED,
    prologue: dict | None = None,
) -> None:
    """Activation rows ``row [M, K]`` (one, or up to ``tiles.dot_gemv_x_rows``) through the integer-dot GEMV
    (:func:`_gemv`'s arguments; ``prologue``: the kernel's arguments for what ``row`` is where it is not the
    product's input itself, :mod:`.grouped_int_norm_launchers`, one row only)."""
    out_features, in_features = weight.shape
    x_rows = row.shape[0] if row.dim() == 2 else 1
    rows = dot_rows(weight, tiles, x_rows)
    if rows & (rows - 1) or rows > 64:
        raise ValueError(f"the integer-dot GEMV runs a power of two rows a program, up to 64, not {rows}")
    if x_rows > 1 and prologue:
        raise ValueError("the integer-dot GEMV fuses its input's norm for one activation row only")
    unused = weight.scales  # any pointer: unread without HAS_PERM / HAS_BIAS
    slots = in_features // (16 if weight.bits == 8 else 32)
    # row groups only where one step takes the whole reduction (and not over 6-bit codes), and one activation row
    one_step = slots <= 32 * tiles.dot_gemv_warps and weight.bits != 6 and x_rows == 1
    groups = tiles.dot_gemv_row_groups if one_step else 1
    programs = triton.cdiv(out_features, rows * groups)
    if gated != gated_rows.NOT_GATED:
        programs = triton.cdiv(out_features // 2, rows // 2 * groups)
    operands = dot_operands(weight, tiles, rows, groups, gated,
                            program_params=x_rows == 1 or tiles.dot_gemv_x_rows_program_params)
    if x_rows > 1:
        operands.update(X_ROWS=x_rows, stride_xm=row.stride(0), stride_om=out.stride(0))
    dot.grouped_int_dot_gemv_kernel[(programs * x_rows,)](
        x_ptr=row, perm_ptr=weight.perm if weight.perm is not None else unused,
        bias_ptr=bias.contiguous() if bias is not None else unused, out_ptr=out, N=out_features,
        HAS_PERM=weight.perm is not None, HAS_BIAS=bias is not None, ROWS=rows, WARPS=tiles.dot_gemv_warps,
        FP16=row.dtype == torch.float16, ASM=tiles.mma_asm, GATED=gated, PREFETCH_PARAMS=tiles.dot_gemv_prefetch_params,
        ROW_GROUPS=groups, VECTOR_MASKS=tiles.dot_gemv_vector_masks, num_warps=tiles.dot_gemv_warps, num_stages=1,
        **operands, **(prologue or {}),
        **pdl.launch_options(), **register_cap(tiles),
    )  # fmt: skip


def _gemv_tile(weight: GroupedIntWeight, tiles: GroupedIntTiles) -> tuple[int, int, int, int]:
    """``(rows, row_bytes, warps, stages)`` of the GEMV that takes ``weight``."""
    return tiles.gemv4 if _takes_words(weight, tiles) else tiles.gemv


def _gemv(
    row: torch.Tensor,
    weight: GroupedIntWeight,
    bias: torch.Tensor | None,
    tiles: GroupedIntTiles,
    out: torch.Tensor,
    gated: int = gated_rows.NOT_GATED,
) -> None:
    """One activation row ``[1, K]`` into ``out [1, N]`` (on the integer-dot GEMV up to ``tiles.dot_gemv_x_rows``
    rows ``[M, K]`` into ``[M, N]``; with ``gated``, on the integer-dot GEMV or at 4 rows a program on the others:
    ``act(gate) * up`` into ``out [M, N / 2]``)."""
    if takes_dot(row, weight, tiles):
        dot_gemv(row, weight, bias, tiles, out, gated)
        return
    if weight.bits == 6:
        # the byte GEMVs read whole bytes a code: 6-bit codes' other rows (float32 ones) take the GEMM
        result = _gemm(row, weight, bias, tiles, out)
        if result is not out:
            out.copy_(result)
        return
    out_features, in_features = weight.shape
    words = _takes_words(weight, tiles)
    rows, row_bytes, warps, stages = _gemv_tile(weight, tiles)
    if rows not in (1, 2, 4) and (rows < 4 or rows & (rows - 1)):
        raise ValueError(f"the GEMV runs 1, 2, 4 or a larger power of two rows a program, not {rows}")
    subs = gemv_subs(weight, row_bytes)
    blocks = in_features // weight.block_k
    unused = weight.scales  # any pointer: unread without HAS_ZS / HAS_PERM / HAS_BIAS
    args = (
        row, weight.codes, weight.scales, weight.zero_scales if weight.zero_scales is not None else unused,
        weight.perm if weight.perm is not None else unused, bias.contiguous() if bias is not None else unused, out,
        out_features, weight.codes.stride(0), weight.scales.stride(0),
    )  # fmt: skip
    common = {
        "NUM_BLOCKS": blocks, "GROUP": weight.group_size, "ZERO": weight.zero_point,
        "HAS_ZS": weight.zero_scales is not None, "HAS_PERM": weight.perm is not None, "HAS_BIAS": bias is not None,
        "BLOCK": weight.block_k, "ROWS": rows, "SUBS": subs, "EVEN": blocks % subs == 0,
        "num_warps": warps, "num_stages": stages, **pdl.launch_options(),
    }  # fmt: skip
    # 4-bit codes against 16-bit activations take the unrolled kernels' path without a subtraction per code
    # (its float32 sums carry terms up to 256 times an activation, held to about 2**-16 of it; for 8-bit
    # codes it ran more instructions than the subtraction saves)
    high = weight.bits == 4 and row.dtype in (torch.bfloat16, torch.float16)
    if rows <= 4:
        common["HIGH"] = high
        common["LOOP_STAGES"] = tiles.gemv_loop_stages
    grid = (triton.cdiv(out_features, rows),)
    if gated != gated_rows.NOT_GATED:
        # two features a program: their gate rows and their up rows
        grid, common["GATED"] = (triton.cdiv(out_features // 2, 2),), gated
    # up to four rows unrolled (the GPU's), more as one tile (the interpreter's): see the kernels
    if rows > 4:
        gk.grouped_int_gemv_wide_kernel[grid](*args, BITS=weight.bits, **common, **super_args(weight))
    elif words:
        g4.grouped_int4_gemv_kernel[grid](*args, g4.FLOAT_ONE_BITS if high else g4.FLOAT_2_23_BITS, **common)
    else:
        gk.grouped_int_gemv_kernel[grid](*args, BITS=weight.bits, **common, **super_args(weight))


def _gemm(
    rows: torch.Tensor, weight: GroupedIntWeight, bias: torch.Tensor | None, tiles: GroupedIntTiles, out: torch.Tensor
) -> torch.Tensor:
    """``rows [M, K]`` into ``out [M, N]`` (returned; a new tensor when the reduction is split)."""
    out_features, in_features = weight.shape
    m = rows.shape[0]
    block_m, block_n, warps, stages = tiles.gemm_tiles(m)
    # a tile spans several packed blocks where they are narrow (float32 tiles keep theirs: shared memory)
    block_k = weight.block_k
    while rows.dtype != torch.float32 and block_k * 2 <= tiles.gemm_block_k and in_features % (block_k * 2) == 0:
        block_k *= 2
    k_blocks = in_features // block_k
    output_tiles = triton.cdiv(m, block_m) * triton.cdiv(out_features, block_n)
    blocks_per_split = triton.cdiv(k_blocks, tiles.split_k(output_tiles, k_blocks))
    splits = triton.cdiv(k_blocks, blocks_per_split)
    target = split_target(out, splits)
    unused = weight.scales  # any pointer: unread without HAS_ZS / HAS_PERM / HAS_BIAS
    gemm_kernels.grouped_int_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(out_features, block_n), splits)](
        rows, weight.codes, weight.scales, weight.zero_scales if weight.zero_scales is not None else unused,
        weight.perm if weight.perm is not None else unused, bias.contiguous() if bias is not None else unused, target,
        m, out_features, blocks_per_split * block_k, rows.stride(0), weight.codes.stride(0),
        weight.scales.stride(0), target.stride(-2), target.stride(0) if splits > 1 else 0,
        K=in_features, GROUP=weight.group_size, BITS=weight.bits, ZERO=weight.zero_point,
        HAS_ZS=weight.zero_scales is not None, HAS_PERM=weight.perm is not None,
        HAS_BIAS=bias is not None and splits == 1,
        PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SUB=weight.block_k, num_warps=warps, num_stages=stages,
        **super_args(weight), **plane_args(weight), **pdl.launch_options(),
    )  # fmt: skip
    return split_result(out, target, splits, bias)

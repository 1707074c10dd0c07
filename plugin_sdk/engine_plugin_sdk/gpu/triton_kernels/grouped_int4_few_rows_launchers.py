"""Host side of the 4-bit grouped-integer products of a few bf16 / fp16 rows on tensor cores: the fragment
kernel (:mod:`.grouped_int4_fragment_kernels`, 1-8 rows, each word of codes an ``mma`` operand) and the tile
kernel (:mod:`.grouped_int4_mma_kernels`, 2-16 rows, codes dequantized into ``tl.dot`` tiles); and the
split-K partial sums they share with the grouped GEMM. :func:`.grouped_int_launchers.grouped_int_linear`
picks among them by the number of rows."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import torch
import triton

from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels import grouped_int4_fragment_kernels as g4f
from engine_plugin_sdk.gpu.triton_kernels import grouped_int4_mma_kernels as g4m
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_gemv_rows as gated_rows
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_params import super_args

if TYPE_CHECKING:
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import GroupedIntTiles
#: the 16-bit float dtypes of the tensor-core kernels' operands, and what their codes carry above the code
TILE_BASE = {torch.bfloat16: 128, torch.float16: 1024}


def split_target(out: torch.Tensor, splits: int) -> torch.Tensor:
    """Where a product's programs write: ``out`` itself, or float32 partial sums ``[splits, M, N]`` when its
    reduction is split (added by :func:`split_result`)."""
    if splits == 1:
        return out
    return torch.empty((splits, *out.shape), dtype=torch.float32, device=out.device)


def split_result(out: torch.Tensor, target: torch.Tensor, splits: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``out`` when unsplit (the kernel added the bias), else the partial sums added, plus the bias, in
    ``out``'s dtype."""
    if splits == 1:
        return out
    summed = target.sum(dim=0)
    if bias is not None:
        summed += bias.float()
    return summed.to(out.dtype)


def fragment_fits(rows: torch.Tensor, weight: GroupedIntWeight, tiles: GroupedIntTiles) -> bool:
    """Whether the fragment kernel takes ``rows`` (any count up to :data:`.grouped_int_tiles.FRAGMENT_MAX_ROWS`)
    with ``weight``."""
    # a lane reads 16 bytes of a 128-column chunk of each of its rows: blocks of whole chunks, or (with
    # fragment_narrow_blocks) blocks of 32 / 64 columns whole chunks hold
    if weight.bits != 4 or rows.dtype not in TILE_BASE:
        return False
    if weight.block_k % 128 == 0:
        return not weight.sub_groups
    return tiles.fragment_narrow_blocks and weight.block_k in (32, 64) and weight.shape[1] % 128 == 0


def fragment_linear(
    rows: torch.Tensor,
    weight: GroupedIntWeight,
    bias: torch.Tensor | None,
    tiles: GroupedIntTiles,
    out: torch.Tensor,
    gated: int = gated_rows.NOT_GATED,
) -> None:
    """``rows [M, K]`` (M <= 8) into ``out [M, N]``, each word of codes a tensor-core operand; or with ``gated``
    (:data:`.elementwise_kernels.SILU` / ``GELU_TANH``) ``act(gate) * up`` of a weight stacking gate rows over
    up rows (``N`` even) into ``out [M, N / 2]``."""
    out_features, in_features = weight.shape
    if rows.stride(0) % 2 or rows.data_ptr() % 4:
        rows = rows.contiguous()  # the kernel reads activation pairs as 32-bit words
    unused = weight.scales  # any pointer: unread without HAS_ZS / HAS_PERM / HAS_BIAS
    # a program's 16 weight rows: 16 features, or 8 features' gate and up rows
    programs = triton.cdiv(out_features, 16) if gated == gated_rows.NOT_GATED else triton.cdiv(out_features // 2, 8)
    wide = programs >= tiles.fragment_narrow_programs
    warps = tiles.fragment_warps if wide else tiles.fragment_narrow_warps
    depth = tiles.fragment_depth if wide else tiles.fragment_narrow_depth or tiles.fragment_depth
    narrow = weight.block_k < 128
    has_zs = weight.zero_scales is not None
    g4f.grouped_int4_fragment_kernel[(programs,)](
        rows, weight.codes, weight.scales, weight.zero_scales if weight.zero_scales is not None else unused,
        weight.perm if weight.perm is not None else unused, bias.contiguous() if bias is not None else unused, out,
        rows.shape[0], out_features, rows.stride(0), weight.codes.stride(0), weight.scales.stride(0), out.stride(0),
        NUM_CHUNKS=in_features // 128, GROUP=weight.group_size, ZERO=weight.zero_point,
        HAS_ZS=has_zs, HAS_PERM=weight.perm is not None, HAS_BIAS=bias is not None,
        BLOCK=weight.block_k, WARPS=warps, FP16=rows.dtype == torch.float16, ASM=tiles.mma_asm,
        DEPTH=depth, AHEAD=bool(tiles.fragment_ahead) and not narrow, GATED=gated, PREFETCH=tiles.fragment_prefetch,
        SUB_BITS=sub_bits(rows.dtype, 0 if has_zs else weight.zero_point) if narrow else 0,
        num_warps=warps, num_stages=1, **super_args(weight), **pdl.launch_options(),
    )  # fmt: skip


def mma_fits(rows: torch.Tensor, weight: GroupedIntWeight, tiles: GroupedIntTiles) -> bool:
    """Whether the tile kernel takes ``rows`` with ``weight``."""
    # the asm's float bit trick holds codes minus an offset below 128 exactly in bf16
    return (
        weight.bits == 4 and weight.block_k >= tiles.gemv4_min_block and rows.dtype in TILE_BASE
        and 0 <= weight.zero_point < 128 and not weight.sub_groups
    )  # fmt: skip


def sub_bits(dtype: torch.dtype, offset: int) -> int:
    """``-(base + offset)`` in ``dtype`` twice over, as the signed int32 the tile kernel's asm takes (plain
    Python: it runs at every launch)."""
    value = -(TILE_BASE[dtype] + offset)
    if dtype == torch.float16:
        half = int.from_bytes(struct.pack("<e", value), "little")
    else:
        # bf16 is float32's upper half, exact for these integers (at most 8 significant bits)
        half = int.from_bytes(struct.pack("<f", value), "little") >> 16
    word = half | (half << 16)
    return word - (1 << 32) if word >= 1 << 31 else word


def mma_linear(
    rows: torch.Tensor, weight: GroupedIntWeight, bias: torch.Tensor | None, tiles: GroupedIntTiles, out: torch.Tensor
) -> torch.Tensor:
    """``rows [M, K]`` (2 <= M <= 16) into ``out [M, N]`` on tensor cores (returned; a new tensor when the
    reduction is split)."""
    out_features, in_features = weight.shape
    m = rows.shape[0]
    block_n, warps, stages = tiles.mma
    blocks = in_features // weight.block_k
    row_tiles = triton.cdiv(out_features, block_n)
    want = min(tiles.max_split_k, triton.cdiv(tiles.mma_programs, row_tiles))
    splits = max(1, min(want, blocks // max(1, tiles.min_split_blocks)))
    splits = triton.cdiv(blocks, triton.cdiv(blocks, splits))  # every split gets blocks
    target = split_target(out, splits)
    unused = weight.scales  # any pointer: unread without HAS_ZS / HAS_PERM / HAS_BIAS
    g4m.grouped_int4_mma_kernel[(row_tiles, splits)](
        rows, weight.codes, weight.scales, weight.zero_scales if weight.zero_scales is not None else unused,
        weight.perm if weight.perm is not None else unused, bias.contiguous() if bias is not None else unused, target,
        m, out_features, rows.stride(0), weight.codes.stride(0), weight.scales.stride(0), target.stride(-2),
        target.stride(0) if splits > 1 else 0,
        sub_bits(rows.dtype, 0 if weight.zero_scales is not None else weight.zero_point),
        NUM_BLOCKS=blocks, GROUP=weight.group_size, ZERO=weight.zero_point, HAS_ZS=weight.zero_scales is not None,
        HAS_PERM=weight.perm is not None, HAS_BIAS=bias is not None and splits == 1, BLOCK=weight.block_k,
        BLOCK_N=block_n, BLOCK_M=16, SPLIT=splits, FP16=rows.dtype == torch.float16, ASM=tiles.mma_asm,
        num_warps=warps, num_stages=stages, **pdl.launch_options(),
    )  # fmt: skip
    return split_result(out, target, splits, bias)

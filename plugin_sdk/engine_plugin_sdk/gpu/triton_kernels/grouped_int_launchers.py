"""Host side of the grouped-integer weight-only GEMM (:mod:`.grouped_int_kernels`): the load-time repacking,
tiles, grids and the split-K reduction."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from engine.interfaces.gemm import QuantizedWeight
from engine.interfaces.grouped_int import GROUPED_INT_BITS, grouped_int_codes
from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_kernels as gk

#: ``tl.dot`` takes a reduction of 16 at least; a 4-bit tile holds two halves of it
MIN_BLOCK_K = {4: 32, 8: 16}


@dataclass(frozen=True, slots=True)
class GroupedIntTiles:
    """Launch parameters of the grouped-integer GEMM on one target.

    Attributes:
        block_k: reduction columns per tile, fixed at load (the 4-bit codes are paired within blocks of
            it); capped at the largest power of two dividing the weight's group size.
        fp32_block_k: the same for float32 activations, whose tiles take twice the shared memory (at
            128 the larger tiles outgrow an MI300's 64 KiB of LDS).
        gemm: ``(max_rows, block_m, block_n, num_warps, num_stages)`` by the number of activation rows: the
            first entry whose ``max_rows`` covers them (the last one past them all). ``block_m`` is at
            least 16 (``tl.dot``'s smallest tile).
        min_programs: split the reduction until the output tiles times the splits reach this many
            programs (about two per multiprocessor), ...
        max_split_k: ... into at most this many splits ...
        min_split_blocks: ... of at least this many ``block_k`` tiles each.
    """

    block_k: int = 128
    fp32_block_k: int = 32
    gemm: tuple[tuple[int, int, int, int, int], ...] = (
        (16, 16, 64, 4, 4), (32, 32, 64, 4, 4), (64, 64, 64, 4, 3), (256, 64, 128, 4, 3), (0, 128, 128, 8, 3),
    )  # fmt: skip
    min_programs: int = 264
    max_split_k: int = 16
    min_split_blocks: int = 2

    def gemm_tiles(self, rows: int) -> tuple[int, int, int, int]:
        """``(block_m, block_n, num_warps, num_stages)`` for ``rows`` activation rows."""
        for max_rows, *tiles in self.gemm[:-1]:
            if rows <= max_rows:
                return tuple(tiles)  # type: ignore[return-value]
        return tuple(self.gemm[-1][1:])  # type: ignore[return-value]

    def split_k(self, output_tiles: int, k_blocks: int) -> int:
        """How many programs share one output tile's ``k_blocks`` reduction tiles."""
        want = min(self.max_split_k, triton.cdiv(self.min_programs, max(1, output_tiles)))
        return max(1, min(want, k_blocks // max(1, self.min_split_blocks)))


#: the defaults, meant for an H200 (132 SMs: ``min_programs`` is two programs each) and used on every GPU;
#: chosen by analogy with the MoE GEMM's tiles, not yet measured on the hardware
H200_GROUPED_INT_TILES = GroupedIntTiles()
#: the interpreter runs each program's tile ops as numpy calls: few, large tiles and no split keep it quick
INTERPRETER_GROUPED_INT_TILES = GroupedIntTiles(
    block_k=128, fp32_block_k=128, gemm=((16, 16, 256, 4, 1), (0, 64, 256, 4, 1)), max_split_k=1
)


def grouped_int_block_k(group_size: int, bits: int, block_k: int) -> int | None:
    """The tile's reduction width for a group size: ``block_k`` capped at the largest power of two that
    divides the group, or None when that is below what ``tl.dot`` takes (the weight is then dequantized)."""
    width = min(block_k, group_size & -group_size)
    return width if width >= MIN_BLOCK_K[bits] else None


def pack_grouped_int(weight: QuantizedWeight, block_k: int, device: torch.device) -> GroupedIntWeight:
    """Repack an ``int4_grouped`` / ``int8_grouped`` weight into the kernel's layout, on ``device``.

    Args:
        weight: the weight in the plugin API's layout (:mod:`engine.interfaces.grouped_int`).
        block_k: the tile's reduction width: a power of two dividing the group size, at least
            :data:`MIN_BLOCK_K` of the bit width (:func:`grouped_int_block_k`).
        device: where the packed weight goes.

    Returns:
        The packed weight (codes K-major, 4-bit codes paired within each ``block_k`` columns, float32
        ``[groups, N]`` scales and ``zeros * scales``, an int32 ``perm`` or None).

    Raises:
        ValueError: for an unknown scheme, a ``block_k`` that does not divide the group size, or parts
            whose shapes do not match the weight's.
    """
    if weight.scheme not in GROUPED_INT_BITS:
        raise ValueError(f"not a grouped integer weight: scheme {weight.scheme!r}")
    bits = GROUPED_INT_BITS[weight.scheme]
    out_features, in_features = (int(d) for d in weight.shape)
    group = int(weight.extra["group_size"])
    if group <= 0 or in_features % group or group % block_k or block_k < MIN_BLOCK_K[bits]:
        raise ValueError(
            f"block_k {block_k} does not fit {in_features} columns in groups of {group} ({bits}-bit)"
        )
    codes = grouped_int_codes(weight)
    scales = torch.as_tensor(weight.extra["scales"]).float()
    zeros = torch.as_tensor(weight.extra["zeros"]).float()
    groups = in_features // group
    if tuple(codes.shape) != (out_features, in_features) or tuple(scales.shape) != (out_features, groups):
        raise ValueError(
            f"{weight.scheme} codes {tuple(codes.shape)} / scales {tuple(scales.shape)} do not match "
            f"{weight.shape} in groups of {group}"
        )
    if tuple(zeros.shape) != tuple(scales.shape):
        raise ValueError(
            f"{weight.scheme} zero points {tuple(zeros.shape)} do not match scales {tuple(scales.shape)}"
        )
    if bits == 4:
        half = block_k // 2
        pairs = codes.reshape(out_features, in_features // block_k, 2, half)
        packed = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(out_features, in_features // 2)
    else:
        packed = codes
    perm = weight.extra.get("perm")
    if perm is not None:
        perm = torch.as_tensor(perm).to(device=device, dtype=torch.int32).contiguous()
    return GroupedIntWeight(
        codes=packed.t().to(device=device, dtype=torch.uint8).contiguous(),
        scales=scales.t().to(device).contiguous(),
        zero_scales=(zeros * scales).t().to(device).contiguous(),
        perm=perm,
        bits=bits,
        group_size=group,
        block_k=block_k,
        shape=(out_features, in_features),
    )


def grouped_int_linear(
    x: torch.Tensor,
    weight: GroupedIntWeight,
    bias: torch.Tensor | None,
    tiles: GroupedIntTiles,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x[..., perm] @ dequant(W).T + bias`` in one kernel (plus a sum over splits of the reduction).

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
    out = torch.empty((m, out_features), dtype=dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], out_features)
    block_m, block_n, warps, stages = tiles.gemm_tiles(m)
    k_blocks = in_features // weight.block_k
    output_tiles = triton.cdiv(m, block_m) * triton.cdiv(out_features, block_n)
    blocks_per_split = triton.cdiv(k_blocks, tiles.split_k(output_tiles, k_blocks))
    splits = triton.cdiv(k_blocks, blocks_per_split)
    # float32 partial sums per split, added below; an unsplit reduction writes the result directly
    if splits == 1:
        target = out
    else:
        target = torch.empty((splits, m, out_features), dtype=torch.float32, device=x.device)
    unused = weight.scales  # any pointer: unread without HAS_PERM / HAS_BIAS
    gk.grouped_int_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(out_features, block_n), splits)](
        rows, weight.codes, weight.scales, weight.zero_scales,
        weight.perm if weight.perm is not None else unused, bias.contiguous() if bias is not None else unused, target,
        m, out_features, blocks_per_split * weight.block_k, rows.stride(0), weight.codes.stride(0),
        weight.scales.stride(0), target.stride(-2), target.stride(0) if splits > 1 else 0,
        K=in_features, GROUP=weight.group_size, BITS=weight.bits, HAS_PERM=weight.perm is not None,
        HAS_BIAS=bias is not None and splits == 1,
        PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=weight.block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        summed = target.sum(dim=0)
        if bias is not None:
            summed += bias.float()
        out = summed.to(dtype)
    return out.reshape(*x.shape[:-1], out_features)

"""Grouped-integer weights in the Triton kernels' layout: the load-time repacking (:func:`pack_grouped_int`), the
reduction sub-block a group size allows, and the float32 values a packed weight stands for (for checks)."""

from __future__ import annotations

import torch

from engine.interfaces.gemm import QuantizedWeight
from engine.interfaces.grouped_int import unpack_int4
from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.grouped_codes import GroupedCodes, dequantize_codes, grouped_codes

#: ``tl.dot`` takes a reduction of 16 at least; a 4-bit tile holds two halves of it
MIN_BLOCK_K = {4: 32, 8: 16}
#: 6-bit codes' block: their low nibbles paired as 4-bit codes' over it, their high bits 8 bytes a block
SIX_BIT_BLOCK = 32


def grouped_int_block_k(group_size: int, bits: int, block_k: int) -> int | None:
    """The tile's reduction width for a group size: ``block_k`` capped at the largest power of two that
    divides the group, or None when that is below what ``tl.dot`` takes (the weight is then dequantized)."""
    width = min(block_k, group_size & -group_size)
    return width if width >= MIN_BLOCK_K[bits] else None


def pack_grouped_int(
    weight: QuantizedWeight, block_k: int, device: torch.device, two_level: bool = True, six_bit: bool = False
) -> GroupedIntWeight:
    """Repack an ``int4_grouped`` / ``int8_grouped`` weight, or a GGUF weight of a type the kernels take
    (:data:`~engine_plugin_sdk.grouped_codes.GGUF_GROUPED_FORMS`), into the kernels' layout on ``device``.

    Args:
        weight: the weight in the plugin API's layout (:mod:`engine.interfaces.grouped_int`, or GGUF blocks).
        block_k: the kernels' reduction sub-block: a power of two dividing the group size, at least
            :data:`MIN_BLOCK_K` of the bit width (:func:`grouped_int_block_k`).
        device: where the packed weight goes (and where GGUF blocks are unpacked).
        two_level: as for :func:`pack_grouped_codes`.
        six_bit: as for :func:`pack_grouped_codes`.

    Returns:
        The packed weight (see :func:`pack_grouped_codes`).

    Raises:
        ValueError: for another scheme, a ``block_k`` that does not fit the group size, or parts whose
            shapes do not match the weight's.
    """
    return pack_grouped_codes(grouped_codes(weight, device), block_k, device, two_level, six_bit)


def pack_grouped_codes(
    codes: GroupedCodes, block_k: int, device: torch.device, two_level: bool = True, six_bit: bool = False
) -> GroupedIntWeight:
    """Pack unpacked codes into the kernels' layout on ``device``.

    Args:
        codes: one code per value and the group parameters.
        block_k: as for :func:`pack_grouped_int`.
        device: where the packed weight goes.
        two_level: keep the scales of codes that come with super-block scales (GGUF's K-quants) as a small
            integer per group and the super-block scale (exactly their product), where they are that.
        six_bit: keep 8-bit codes that all fit 6 bits (GGUF's Q6_K) in 6, in groups of a multiple of 16 columns
            (:func:`six_bit_fits`): their low nibbles as 4-bit codes in blocks of :data:`SIX_BIT_BLOCK`, whatever
            ``block_k``, and a plane of their high bits (:class:`GroupedIntWeight`).

    Returns:
        The packed weight: codes row-major, 4-bit codes paired within each ``block_k`` columns; scales and
        zero scales ``[out, groups]`` in float16 where that is exact, else float32 (or two-level); an int32
        ``perm`` or None.

    Raises:
        ValueError: for a ``block_k`` that does not divide the group size or is below :data:`MIN_BLOCK_K`.
    """
    bits, group = codes.bits, codes.group_size
    out_features, in_features = (int(d) for d in codes.codes.shape)
    if group <= 0 or in_features % group or group % block_k or block_k < MIN_BLOCK_K[bits]:
        raise ValueError(f"block_k {block_k} does not fit {in_features} columns in groups of {group} ({bits}-bit)")
    values = codes.codes.to(device=device, dtype=torch.uint8)
    high_bits = None
    if six_bit and six_bit_fits(codes):
        bits, block_k = 6, SIX_BIT_BLOCK
        values, high_bits = _six_bit_planes(values)
    elif bits == 4:
        values = _nibble_pairs(values, block_k)
    perm = None if codes.perm is None else codes.perm.to(device=device, dtype=torch.int32).contiguous()
    scales = _narrowest(codes.scales.to(device))
    zero_scales = None if codes.zero_scales is None else _narrowest(codes.zero_scales.to(device))
    sub_groups, supers = 0, (None, None)
    split = _two_level(codes, device) if two_level and codes.sub_groups else None
    if split is not None:
        scales, zero_scales, supers, sub_groups = split[0], split[1], split[2], codes.sub_groups
    return GroupedIntWeight(
        codes=values.contiguous(),
        scales=scales,
        zero_scales=zero_scales,
        perm=perm,
        bits=bits,
        group_size=group,
        block_k=block_k,
        shape=(out_features, in_features),
        zero_point=codes.zero_point,
        sub_groups=sub_groups,
        super_scales=supers[0],
        super_zero_scales=supers[1],
        high_bits=high_bits,
    )


def six_bit_fits(codes: GroupedCodes) -> bool:
    """Whether 8-bit ``codes`` may be kept in 6 bits: every code below 64, groups of a multiple of 16 columns
    (each block's halves lie in one group), whole blocks of :data:`SIX_BIT_BLOCK` columns."""
    in_features = int(codes.codes.shape[1])
    return (
        codes.bits == 8 and codes.group_size % 16 == 0 and in_features % SIX_BIT_BLOCK == 0
        and codes.codes.numel() > 0 and int(codes.codes.max()) < 64
    )  # fmt: skip


def _nibble_pairs(values: torch.Tensor, block_k: int) -> torch.Tensor:
    """4-bit codes ``[out, in]`` paired within each ``block_k`` columns: ``[out, in / 2]``."""
    out_features, in_features = (int(d) for d in values.shape)
    pairs = values.reshape(out_features, in_features // block_k, 2, block_k // 2)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(out_features, in_features // 2)


def _six_bit_planes(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """6-bit codes ``[out, in]`` as their low nibbles paired over blocks of 32 columns and the plane of their high
    bits ``[out, in / 4]`` (:class:`GroupedIntWeight`'s layout)."""
    out_features, in_features = (int(d) for d in values.shape)
    nibbles = _nibble_pairs(values & 0x0F, SIX_BIT_BLOCK)
    # [out, block, half (A: columns 0-15, B: 16-31), i, k]: column 16 half + 4 i + k, its two bits at 2 i of byte k
    high = (values >> 4).reshape(out_features, in_features // SIX_BIT_BLOCK, 2, 4, 4)
    plane = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
    return nibbles.contiguous(), plane.reshape(out_features, in_features // 4).contiguous()


def six_bit_codes(weight: GroupedIntWeight) -> torch.Tensor:
    """uint8 ``[out, in]`` codes of a 6-bit packed weight, stored column order (for checks)."""
    out_features, in_features = weight.shape
    low = _unpaired_nibbles(weight.codes, out_features, in_features, SIX_BIT_BLOCK)
    plane = weight.high_bits.reshape(out_features, in_features // SIX_BIT_BLOCK, 2, 1, 4)
    high = torch.cat([(plane >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=3)
    return low | (high.reshape(out_features, in_features) << 4)


def _unpaired_nibbles(codes: torch.Tensor, out_features: int, in_features: int, block_k: int) -> torch.Tensor:
    """The inverse of :func:`_nibble_pairs`."""
    split = unpack_int4(codes).reshape(out_features, in_features // block_k, block_k // 2, 2)
    return split.transpose(-1, -2).reshape(out_features, in_features)


def _two_level(codes: GroupedCodes, device: torch.device) -> tuple | None:
    """``(scales, zero_scales, (super_scales, super_zero_scales))`` of codes whose scales are each a small
    integer times their super-block's (the integers as uint8 / int8, the super-block scales as
    :func:`_narrowest` has them), or None where one of them is not that exactly."""
    sub = _integers(codes.scales.to(device), codes.super_scales, codes.sub_groups, device)
    if sub is None:
        return None
    zero_sub = None
    if codes.zero_scales is not None:
        zero_sub = _integers(codes.zero_scales.to(device), codes.super_zero_scales, codes.sub_groups, device)
        if zero_sub is None:
            return None
    super_zero = None if zero_sub is None else _narrowest(codes.super_zero_scales.to(device))
    return sub, zero_sub, (_narrowest(codes.super_scales.to(device)), super_zero)


def _integers(values: torch.Tensor, supers: torch.Tensor | None, sub_groups: int, device: torch.device):
    """``values [out, groups]`` over their super-block's ``supers [out, groups / sub_groups]`` as uint8 / int8
    integers, or None where a quotient is not an integer of 8 bits or the product does not give the value back."""
    if supers is None:
        return None
    wide = supers.to(device).float().repeat_interleave(sub_groups, dim=1)
    if wide.shape != values.shape:
        return None
    quotient = torch.where(wide == 0, torch.zeros_like(values), values.float() / wide).round()
    if not quotient.numel():
        return None
    low, high = float(quotient.min()), float(quotient.max())
    dtype = torch.uint8 if low >= 0 and high <= 255 else torch.int8 if low >= -128 and high <= 127 else None
    if dtype is None or not torch.equal(quotient * wide, values.float()):
        return None
    return quotient.to(dtype).contiguous()


def dequantize_packed(weight: GroupedIntWeight) -> torch.Tensor:
    """float32 ``[out, in]`` of a packed weight in stored column order, by the kernels' formula (for checks)."""
    out_features, in_features = weight.shape
    codes = weight.codes
    if weight.bits == 6:
        codes = six_bit_codes(weight)
    elif weight.bits == 4:
        codes = _unpaired_nibbles(codes, out_features, in_features, weight.block_k)
    unpacked = GroupedCodes(
        codes, group_scales(weight, weight.scales, weight.super_scales),
        None if weight.zero_scales is None else group_scales(weight, weight.zero_scales, weight.super_zero_scales),
        weight.zero_point, 8 if weight.bits == 6 else weight.bits, weight.group_size,
    )  # fmt: skip
    return dequantize_codes(unpacked)


def group_scales(weight: GroupedIntWeight, scales: torch.Tensor, supers: torch.Tensor | None) -> torch.Tensor:
    """float32 ``[out, groups]`` of ``weight``'s ``scales`` (or zero scales), two-level ones multiplied out."""
    if not weight.sub_groups:
        return scales.float()
    return scales.float() * supers.float().repeat_interleave(weight.sub_groups, dim=1)


def _narrowest(values: torch.Tensor) -> torch.Tensor:
    """float16 when it holds every value exactly (half the bytes the kernels stream), else float32."""
    values = values.float().contiguous()
    half = values.half()
    return half if torch.equal(half.float(), values) else values

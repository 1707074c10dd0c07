"""Grouped-integer weights unpacked to one code per value, with their group scales: the form the GPU
plugins' weight-only kernels are packed from, and the loader's fast path to float32 for GGUF blocks.
It is reached from the plugin API's ``int4_grouped`` / ``int8_grouped`` weights and, exactly, from twelve GGUF
block types. Plugins reach it through ``engine_plugin_sdk.grouped_codes``.

A GGUF type is kept when every value of it is ``code * scale - zero_scale`` (or ``(code - zero_point) *
scale``) with one scale pair per fixed group of columns, computed in float32 with the same roundings as the
reference dequantizer (``gguf.quants``), so that the repacked weight dequantizes to the same bits:

- ``Q4_0``: 4-bit codes, groups of 32, ``(q - 8) * d``;
- ``Q4_1``: 4-bit, groups of 32, ``q * d + m`` (``zero_scale = -m``);
- ``Q8_0``: 8-bit (the int8 value plus 128), groups of 32, ``(q - 128) * d``;
- ``Q4_K``: 4-bit, super-blocks of 256 in eight groups of 32, ``(d * sc) * q - dmin * mn``: both products
  are exact in float32 (an fp16 times a 6-bit integer), as is ``d * sc * q``;
- ``Q6_K``: 6-bit codes in 8-bit storage, sixteen groups of 16 per super-block, ``(q - 32) * (d * sc)``;
- ``Q5_0`` / ``Q5_1``: 5-bit codes (a nibble and a bit from the block's 32-bit ``qh``) in 8-bit storage, groups of
  32, ``(q - 16) * d`` / ``q * d + m``;
- ``Q5_K``: 5-bit codes in 8-bit storage, Q4_K's super-blocks, scales and formula;
- ``Q3_K``: 3-bit codes (two bits and a high bit) in 8-bit storage, sixteen groups of 16 per super-block,
  ``(q - 4) * (d * (sc - 32))``: an fp16 times a 6-bit integer is exact in float32, as is its product with
  ``q - 4``;
- ``Q2_K``: 2-bit codes in 8-bit storage, sixteen groups of 16 per super-block, ``(d * sc) * q - dmin * mn``
  with 4-bit ``sc`` and ``mn`` (Q4_K's formula and exactness);
- ``IQ4_NL`` / ``IQ4_XS``: a nibble indexes a fixed table of 16 int8 values, so the table's value plus 128 is an
  8-bit code with Q8_0's zero point: groups of 32, ``(q - 128) * d`` (IQ4_XS: ``d * (ls - 32)`` with a 6-bit
  ``ls`` per group under the super-block's ``d``).

The other GGUF types (the other IQ types, ...) have no such form and dequantize through ``gguf.quants``.
Unpacking in torch is what makes loading a GGUF file quick: the embedded 135M model's tensors take 0.9 s
this way against 4 s through ``gguf.quants`` (a 2-core CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.interfaces.gemm import QuantizedWeight
from engine.interfaces.grouped_int import GROUPED_INT_BITS, grouped_int_codes

#: GGUF scheme -> (bits per code, columns per group) of its grouped-integer form
GGUF_GROUPED_FORMS = {
    "gguf_q4_0": (4, 32), "gguf_q4_1": (4, 32), "gguf_q8_0": (8, 32), "gguf_q4_k": (4, 32), "gguf_q6_k": (8, 16),
    "gguf_q5_0": (8, 32), "gguf_q5_1": (8, 32), "gguf_q5_k": (8, 32), "gguf_q3_k": (8, 16),
    "gguf_q2_k": (8, 16), "gguf_iq4_nl": (8, 32), "gguf_iq4_xs": (8, 32),
}  # fmt: skip
GGUF_GROUPED_SCHEMES = frozenset(GGUF_GROUPED_FORMS)
#: GGUF scheme -> (values, bytes) of one block
_BLOCKS = {
    "gguf_q4_0": (32, 18), "gguf_q4_1": (32, 20), "gguf_q8_0": (32, 34), "gguf_q4_k": (256, 144),
    "gguf_q6_k": (256, 210), "gguf_q5_0": (32, 22), "gguf_q5_1": (32, 24), "gguf_q5_k": (256, 176),
    "gguf_q3_k": (256, 110), "gguf_q2_k": (256, 84), "gguf_iq4_nl": (32, 18), "gguf_iq4_xs": (256, 136),
}  # fmt: skip
#: IQ4_NL / IQ4_XS's values of their 16 nibbles (ggml's ``kvalues_iq4nl``)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(slots=True)
class GroupedCodes:
    """One code per value and the group parameters of a grouped-integer weight.

    Attributes:
        codes: uint8 ``[out, in]`` unsigned codes, stored column order.
        scales: float32 ``[out, groups]``.
        zero_scales: float32 ``[out, groups]`` (value ``code * scale - zero_scale``), or None when every
            group has the zero point ``zero_point`` (value ``(code - zero_point) * scale``).
        zero_point: the shared zero point in code units (read only when ``zero_scales`` is None).
        bits: 4 or 8: the codes' storage width (Q5 / Q6 codes: 8).
        group_size: columns per group.
        perm: int64 ``[in]`` act-order (stored column ``j`` is input feature ``perm[j]``), or None.
        sub_groups: GGUF's K-quants: groups per super-block, whose scales (and zero scales) are a super-block
            scale times a small integer per group (0: no such form).
        super_scales: float32 ``[out, groups / sub_groups]`` of those, each an fp16 value (``scales`` is each
            times its group's integer, exactly), or None.
        super_zero_scales: the same for the zero scales, or None.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zero_scales: torch.Tensor | None
    zero_point: int
    bits: int
    group_size: int
    perm: torch.Tensor | None = None
    sub_groups: int = 0
    super_scales: torch.Tensor | None = None
    super_zero_scales: torch.Tensor | None = None


def grouped_form(weight: QuantizedWeight) -> tuple[int, int] | None:
    """``(bits, group_size)`` of a weight the Triton kernels can take, or None for another scheme."""
    if weight.scheme in GGUF_GROUPED_FORMS:
        return GGUF_GROUPED_FORMS[weight.scheme]
    if weight.scheme in GROUPED_INT_BITS:
        return GROUPED_INT_BITS[weight.scheme], int(weight.extra["group_size"])
    return None


def grouped_codes(weight: QuantizedWeight, device: torch.device) -> GroupedCodes:
    """A grouped-integer or GGUF weight as :class:`GroupedCodes` on ``device``.

    Args:
        weight: an ``int4_grouped`` / ``int8_grouped`` weight (:mod:`engine.interfaces.grouped_int`) or a
            GGUF weight of a scheme in :data:`GGUF_GROUPED_FORMS` (``data`` ``[out, bytes_per_row]``).
        device: where to unpack (a GPU unpacks a large checkpoint in moments).

    Returns:
        The codes and group parameters.

    Raises:
        ValueError: for another scheme, or parts whose shapes do not match the weight's.
    """
    if weight.scheme in GGUF_GROUPED_FORMS:
        return _gguf_codes(weight, device)
    if weight.scheme not in GROUPED_INT_BITS:
        raise ValueError(f"not a grouped integer or repackable GGUF weight: scheme {weight.scheme!r}")
    bits = GROUPED_INT_BITS[weight.scheme]
    out_features, in_features = (int(d) for d in weight.shape)
    group = int(weight.extra["group_size"])
    if group <= 0 or in_features % group:
        raise ValueError(f"{weight.scheme}: {in_features} columns do not split into groups of {group}")
    codes = grouped_int_codes(weight).to(device)
    scales = torch.as_tensor(weight.extra["scales"]).to(device=device, dtype=torch.float32)
    zeros = torch.as_tensor(weight.extra["zeros"]).to(device=device, dtype=torch.float32)
    if tuple(codes.shape) != (out_features, in_features) or tuple(scales.shape) != (out_features, in_features // group):
        raise ValueError(
            f"{weight.scheme} codes {tuple(codes.shape)} / scales {tuple(scales.shape)} do not match "
            f"{weight.shape} in groups of {group}"
        )
    if tuple(zeros.shape) != tuple(scales.shape):
        raise ValueError(f"{weight.scheme} zero points {tuple(zeros.shape)} do not match scales {tuple(scales.shape)}")
    perm = weight.extra.get("perm")
    perm = None if perm is None else torch.as_tensor(perm).to(device=device, dtype=torch.int64)
    shared = _shared_zero_point(zeros, bits)
    # a symmetric checkpoint (one zero point, GPTQ's usual) needs no zero scales: a stream less to read
    zero_scales = None if shared is not None else zeros * scales
    return GroupedCodes(codes, scales, zero_scales, shared or 0, bits, group, perm)


def dequantize_codes(codes: GroupedCodes) -> torch.Tensor:
    """float32 ``[out, in]`` in stored column order, by the formula the kernels use (``perm`` not undone)."""
    rows, cols = codes.codes.shape
    # in place over [out, groups, group] with the scales broadcast: three passes over the output where
    # expanded scale tensors took five (this runs on every GGUF matrix a load dequantizes). Multiply then
    # subtract, never a fused multiply-add, so that the bits are the reference's
    values = codes.codes.reshape(rows, -1, codes.group_size).float()
    if codes.zero_scales is None:
        values.sub_(codes.zero_point)
    values.mul_(codes.scales.float().unsqueeze(-1))
    if codes.zero_scales is not None:
        values.sub_(codes.zero_scales.float().unsqueeze(-1))
    return values.reshape(rows, cols)


def _shared_zero_point(zeros: torch.Tensor, bits: int) -> int | None:
    """The one integral zero point every group has, or None."""
    if zeros.numel() == 0:
        return None
    first = float(zeros.reshape(-1)[0])
    if first != round(first) or not 0 <= first < 2**bits or not bool((zeros == first).all()):
        return None
    return int(first)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of every block, as float32 ``[blocks, 1]``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and mins ``[blocks, 8]`` of Q4_K / Q5_K's eight sub-blocks from their 12 bytes
    (``gguf.quants.Q4_K.get_scale_min``)."""
    lo, hi, mixed = packed.reshape(-1, 3, 4).unbind(1)
    sc = torch.cat([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mn = torch.cat([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], dim=1)
    return sc, mn


def _two_bit_quants(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K / Q3_K's 2-bit quants ``[blocks, 8, 32]`` from their 64 bytes: bits ``2 j`` of byte ``32 h + l`` are
    value ``128 h + 32 j + l``."""
    ql = qs.reshape(-1, 2, 1, 32)
    return torch.cat([(ql >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=2).reshape(-1, 8, 32)


def _gguf_codes(weight: QuantizedWeight, device: torch.device) -> GroupedCodes:
    """Unpack GGUF blocks (the layouts of ``gguf.quants``) into codes and float32 group parameters."""
    out_features, in_features = (int(d) for d in weight.shape)
    values, nbytes = _BLOCKS[weight.scheme]
    bits, group = GGUF_GROUPED_FORMS[weight.scheme]
    data = torch.as_tensor(weight.data)
    if data.dtype != torch.uint8 or in_features % values or tuple(data.shape) != (out_features, in_features // values * nbytes):
        raise ValueError(
            f"{weight.scheme} data {data.dtype} {tuple(data.shape)} does not hold a {weight.shape} weight "
            f"in blocks of {values} values / {nbytes} bytes"
        )
    blocks = data.to(device).reshape(-1, nbytes)
    zero_scales: torch.Tensor | None = None
    zero_point = 0
    # the K-quants' super-block scales (the fp16 d and dmin of each 256 values)
    supers: tuple[torch.Tensor, torch.Tensor | None] | None = None
    if weight.scheme in ("gguf_q4_0", "gguf_q4_1"):
        qs = blocks[:, -16:]
        # low nibbles are values 0..15 of the block, high nibbles 16..31
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=1)
        scales = _half(blocks, 0)
        if weight.scheme == "gguf_q4_1":
            zero_scales = -_half(blocks, 2)
        else:
            zero_point = 8
    elif weight.scheme == "gguf_q8_0":
        # int8 q as the unsigned code q + 128 (flipping the sign bit): value (code - 128) * d
        codes = blocks[:, 2:] ^ 0x80
        scales, zero_point = _half(blocks, 0), 128
    elif weight.scheme in ("gguf_q5_0", "gguf_q5_1"):
        start = 2 if weight.scheme == "gguf_q5_0" else 4
        qs = blocks[:, start + 4 :]
        # value i's high bit is bit i of the little-endian 32-bit qh: bit i % 8 of its byte i // 8
        qh = blocks[:, start : start + 4]
        high = torch.stack([(qh >> b) & 1 for b in range(8)], dim=2).reshape(-1, 32)
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=1) | (high << 4)
        scales = _half(blocks, 0)
        if weight.scheme == "gguf_q5_1":
            zero_scales = -_half(blocks, 2)
        else:
            zero_point = 16
    elif weight.scheme in ("gguf_q4_k", "gguf_q5_k"):
        d, dmin = _half(blocks, 0), _half(blocks, 2)
        sc, mn = _k_scales_mins(blocks[:, 4:16])
        scales, zero_scales = d * sc.float(), dmin * mn.float()
        supers = (d, dmin)
        # each 32-byte chunk holds sub-block 2c in its low nibbles and 2c + 1 in its high ones
        qs = blocks[:, 16:144] if weight.scheme == "gguf_q4_k" else blocks[:, 48:176]
        codes = torch.cat([qs.reshape(-1, 4, 1, 32) & 0x0F, qs.reshape(-1, 4, 1, 32) >> 4], dim=2).reshape(-1, 256)
        if weight.scheme == "gguf_q5_k":
            # sub-block i's high bits: bit i of the 32 bytes of qh, value j's in byte j
            qh = blocks[:, 16:48]
            high = torch.stack([(qh >> i) & 1 for i in range(8)], dim=1).reshape(-1, 256)
            codes = codes | (high << 4)
    elif weight.scheme in ("gguf_iq4_nl", "gguf_iq4_xs"):
        # a run of 16 bytes holds its 32 values' nibbles, values 0..15 low and 16..31 high; a value's code is its
        # table entry plus 128
        qs = blocks[:, 2:] if weight.scheme == "gguf_iq4_nl" else blocks[:, 8:]
        qs = qs.reshape(-1, qs.shape[1] // 16, 1, 16)
        nibbles = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(blocks.shape[0], -1)
        table = torch.tensor([v + 128 for v in IQ4_VALUES], dtype=torch.uint8, device=blocks.device)
        codes = table[nibbles.long()]
        zero_point = 128
        d = _half(blocks, 0)
        if weight.scheme == "gguf_iq4_nl":
            scales = d
        else:
            # group j's 6-bit ls: nibble j % 2 of byte 4 + j // 2, its top two bits at bits 2 j of the 16-bit word
            low = blocks[:, 4:8].reshape(-1, 4, 1) >> torch.tensor([0, 4], dtype=torch.uint8, device=blocks.device)
            word = blocks[:, 2].int() | (blocks[:, 3].int() << 8)
            high = (word[:, None] >> (2 * torch.arange(8, device=blocks.device))) & 0x03
            ls = (low.reshape(-1, 8).int() & 0x0F) | (high << 4)
            scales = d * (ls.float() - 32.0)
            supers = (d, None)
    elif weight.scheme == "gguf_q2_k":
        codes = _two_bit_quants(blocks[:, 16:80]).reshape(-1, 256)
        # group g's scale in the low nibble of byte g, its min in the high one
        d, dmin = _half(blocks, 80), _half(blocks, 82)
        scales, zero_scales = d * (blocks[:, 0:16] & 0x0F).float(), dmin * (blocks[:, 0:16] >> 4).float()
        supers = (d, dmin)
    elif weight.scheme == "gguf_q3_k":
        low = _two_bit_quants(blocks[:, 32:96])
        # value 128 h + 32 j + l's high bit is bit 4 h + j of byte l
        high = torch.stack([(blocks[:, 0:32] >> b) & 1 for b in range(8)], dim=1)
        codes = (low | (high << 2)).reshape(-1, 256)
        # group g's 6-bit scale: the nibble g // 8 of byte g % 8, and bits 2 (g // 4) of byte 8 + g % 4 above it
        raw = blocks[:, 96:108]
        nibble = torch.cat([raw[:, 0:8] & 0x0F, raw[:, 0:8] >> 4], dim=1)
        pair = torch.cat([(raw[:, 8:12] >> (2 * i)) & 0x03 for i in range(4)], dim=1)
        d = _half(blocks, 108)
        scales = d * ((nibble | (pair << 4)).float() - 32.0)
        zero_point = 4
        supers = (d, None)
    else:  # gguf_q6_k
        ql = blocks[:, :128].reshape(-1, 2, 1, 64)
        qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
        low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 8, 32)
        high = torch.cat([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=2).reshape(-1, 8, 32)
        codes = (low | (high << 4)).reshape(-1, 256)
        d = _half(blocks, 208)
        scales = d * blocks[:, 192:208].contiguous().view(torch.int8).float()
        zero_point = 32
        supers = (d, None)
    groups = in_features // group
    sub_groups = values // group if supers is not None else 0
    rows = (out_features, in_features // values)
    return GroupedCodes(
        codes=codes.reshape(out_features, in_features).contiguous(),
        scales=scales.reshape(out_features, groups).contiguous(),
        zero_scales=None if zero_scales is None else zero_scales.reshape(out_features, groups).contiguous(),
        zero_point=zero_point,
        bits=bits,
        group_size=group,
        sub_groups=sub_groups,
        super_scales=None if supers is None else supers[0].reshape(rows).contiguous(),
        super_zero_scales=None if supers is None or supers[1] is None else supers[1].reshape(rows).contiguous(),
    )

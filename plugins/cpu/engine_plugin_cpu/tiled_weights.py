"""GGUF blocks regrouped into the C kernels' 16-row tile records (``csrc/quantized_linear.c`` reads them): each
type's codes and group scales, as the SDK unpacks them (:mod:`engine_plugin_sdk.grouped_codes`, bit for bit
``gguf.quants``' values), in one of the record kinds of :class:`TiledWeight`, their scales rounded to fp16 (exact
where they are an fp16 value; a K-quant's ``d * sc`` within 2^-11)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_plugin_cpu.quant_pack import gguf_codes, nibbles
from engine_plugin_sdk.grouped_codes import GroupedCodes

#: output rows per weight tile (one per 32-bit lane of a 512-bit register)
TILE_ROWS = 16


@dataclass(slots=True)
class TiledWeight:
    """A GGUF 4-, 6- or 8-bit matrix regrouped into the C kernels' 16-row tile records.

    Attributes:
        bits: 4 (``w = d * q + m``, q in 0..15; with ``iq4``, ``w = d * table[q]``), 8 (``w = d * q``, q in
            -127..127), 6 (GGUF Q6_K: ``w = d * q``, q in -32..31, one ``d`` per 16 weights; GGUF Q3_K's too, q in
            -4..3), 5 (GGUF Q5_K: ``w = d * q + m``, q in 0..31, in 8-bit records) or 2 (GGUF Q2_K: ``w = d * q + m``,
            q in 0..3, a ``d`` and an ``m`` per 16 weights, in 8-bit records).
        records: uint8 ``[ceil(out / 16), in / 32, record bytes]`` (layout in ``csrc/quantized_linear.c``).
        out_features: rows of the logical weight (padding rows of the last tile are zero).
        in_features: columns, a multiple of 32.
        iq4: 4-bit records whose nibbles index GGUF IQ4's table of 16 values (IQ4_NL / IQ4_XS).
    """

    bits: int
    records: torch.Tensor
    out_features: int
    in_features: int
    iq4: bool = False


def _tile_rows(t: torch.Tensor, out: int) -> torch.Tensor:
    """Pad dim 0 of ``t`` with zeros to whole tiles and split it: ``[tiles, 16, ...]``."""
    pad = -out % TILE_ROWS
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(-1, TILE_ROWS, *t.shape[1:])


def _fp16_lanes(values: torch.Tensor, out: int) -> torch.Tensor:
    """fp16 ``[out, blocks]`` as bytes ``[tiles, blocks, 32]``: a tile's 16 rows side by side."""
    return _tile_rows(values, out).transpose(1, 2).contiguous().view(torch.uint8)


def _codes(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> GroupedCodes:
    return gguf_codes(data, "gguf_" + type_name.lower(), shape)


def _scale_and_min(codes: GroupedCodes) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 ``d`` and ``m`` ``[out, groups]`` of ``w = d * q + m`` (a zero point or a zero scale folded into ``m``)."""
    zero = codes.zero_scales if codes.zero_scales is not None else codes.scales * codes.zero_point
    return codes.scales.to(torch.float16), (-zero).to(torch.float16)


def _nibble_records(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, out: int, width: int) -> torch.Tensor:
    """4-bit records ``[tiles, width / 32, 320]`` of nibbles ``q [out, blocks, 32]`` and fp16 ``d``, ``m``
    ``[out, blocks]``."""
    # weight k = 8c + 4h + j -> byte (c, lane, j), nibble h
    q = _tile_rows(q, out).reshape(-1, TILE_ROWS, width // 32, 4, 2, 4)
    q = q.permute(0, 2, 3, 1, 5, 4)  # tile, block, chunk, lane, j, h
    packed = (q[..., 0] | (q[..., 1] << 4)).reshape(q.shape[0], q.shape[1], 256)
    return torch.cat([packed, _fp16_lanes(d, out), _fp16_lanes(m, out)], dim=-1).contiguous()


def _byte_tiles(q: torch.Tensor, out: int, width: int) -> torch.Tensor:
    """Signed ``q`` ``[out, width]`` (int16) as unsigned bytes ``[tiles, width / 32, 512]``: chunk c of a
    block holds weights 4c..4c+3 of each of the tile's 16 rows, + 128."""
    q = (q + 128).to(torch.uint8)
    q = _tile_rows(q, out).reshape(-1, TILE_ROWS, width // 32, 8, 4)
    return q.permute(0, 2, 3, 1, 4).reshape(q.shape[0], width // 32, 512)


def _halves(values: torch.Tensor, out: int) -> list[torch.Tensor]:
    """fp16 lanes of per-16-weight values ``[out, in / 16]``: the first halves' of each 32-weight block, then the
    second halves'."""
    pairs = values.to(torch.float16).reshape(out, -1, 2)
    return [_fp16_lanes(pairs[..., 0], out), _fp16_lanes(pairs[..., 1], out)]


def tile_q4(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> TiledWeight:
    """GGUF Q4_0 / Q4_1 / Q4_K bytes as 4-bit tile records (320 bytes per tile and block; Q4_0's zero point as
    ``m = -8 d``, exact in fp16).

    Raises:
        ValueError: for bytes that do not match the shape.
    """
    out, width = shape
    codes = _codes(data, type_name, shape)
    d, m = _scale_and_min(codes)
    return TiledWeight(4, _nibble_records(codes.codes.reshape(out, -1, 32), d, m, out, width), out, width)


def tile_iq4(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> TiledWeight:
    """GGUF IQ4_NL / IQ4_XS bytes as IQ4 tile records: their nibbles as they are (the kernel looks their values up;
    each block's 16 nibble bytes end it) and ``d`` per 32 weights (IQ4_XS's ``d * (ls - 32)`` rounded to fp16).

    Raises:
        ValueError: for bytes that do not match the shape.
    """
    out, width = shape
    d = _codes(data, type_name, shape).scales.to(torch.float16)
    block_bytes, values = (18, 32) if type_name == "IQ4_NL" else (136, 256)
    runs = data.reshape(out, width // values, block_bytes)[..., block_bytes - values // 2 :]
    q = nibbles(runs.reshape(out, -1, 16))
    return TiledWeight(4, _nibble_records(q, d, torch.zeros_like(d), out, width), out, width, iq4=True)


def tile_q6(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> TiledWeight:
    """GGUF Q6_K / Q3_K bytes as 6-bit tile records (576 bytes per tile and 32-weight block): the codes less their
    zero point (Q6_K's -32..31, Q3_K's -4..3) as signed bytes, then a ``d`` per 16 weights (``d * sc``; Q3_K's
    ``d * (sc - 32)``).

    Raises:
        ValueError: for bytes that do not match the shape.
    """
    out, width = shape
    codes = _codes(data, type_name, shape)
    q = codes.codes.to(torch.int16) - codes.zero_point
    records = torch.cat([_byte_tiles(q, out, width), *_halves(codes.scales, out)], dim=-1)
    return TiledWeight(6, records.contiguous(), out, width)


def tile_q2(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> TiledWeight:
    """GGUF Q2_K bytes as 2-bit tile records (640 bytes per tile and 32-weight block): Q6_K's records with q in
    0..3, then an ``m`` per 16 weights (``w = d * sc * q - dmin * mn``: ``m = -dmin * mn``).

    Raises:
        ValueError: for bytes that do not match the shape.
    """
    out, width = shape
    codes = _codes(data, type_name, shape)
    d, m = _scale_and_min(codes)
    records = torch.cat([_byte_tiles(codes.codes.to(torch.int16), out, width), *_halves(d, out), *_halves(m, out)], dim=-1)
    return TiledWeight(2, records.contiguous(), out, width)


def tile_q5(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> TiledWeight:
    """GGUF Q5_K / Q5_1 bytes as 5-bit tile records (576 bytes per tile and 32-weight block): the 8-bit records'
    bytes holding q as it is, then ``d`` and ``m`` (Q5_1's own fp16 pair; Q5_K's ``d * sc`` and ``-dmin * mn``).

    Raises:
        ValueError: for bytes that do not match the shape.
    """
    out, width = shape
    codes = _codes(data, type_name, shape)
    d, m = _scale_and_min(codes)
    # _byte_tiles stores q + 128: unsigned q as it is
    q = _byte_tiles(codes.codes.to(torch.int16) - 128, out, width)
    return TiledWeight(5, torch.cat([q, _fp16_lanes(d, out), _fp16_lanes(m, out)], dim=-1).contiguous(), out, width)


def tile_q8(data: torch.Tensor, shape: tuple[int, int]) -> TiledWeight:
    """GGUF Q8_0 bytes as 8-bit tile records (544 bytes per tile and block), keeping every block scale.

    Raises:
        ValueError: for bytes that do not match the shape.
    """
    out, width = shape
    codes = _codes(data, "Q8_0", shape)
    # signed q + 128 as unsigned bytes: the kernel removes 128 * sum(x) again
    q = _byte_tiles(codes.codes.to(torch.int16) - codes.zero_point, out, width)
    return TiledWeight(8, torch.cat([q, _fp16_lanes(codes.scales.to(torch.float16), out)], dim=-1).contiguous(), out, width)

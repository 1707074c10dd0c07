"""GGUF blocks unpacked with torch and repacked for torch's weight-only int4 / int8 CPU matmuls.

GGUF stores a matrix row by row as blocks of 32 weights (``engine_plugin_sdk.quant`` documents the
``QuantizedWeight`` layout): Q4_0 is an fp16 scale ``d`` and 16 bytes of nibbles, ``w = d * (q - 8)``;
Q4_1 adds an fp16 minimum ``m``, ``w = d * q + m``; Q8_0 is ``d`` and 32 int8, ``w = d * q``. In a
block's 16 nibble bytes, byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its
high one.

torch's int4 kernel (``_weight_int4pack_mm_for_cpu``) computes with ``w = (q - 8) * scale + zero`` per
group of input columns, so Q4_0 and Q4_1 map onto it exactly (group 32, ``zero = m + 8 d``). Its int8
kernel (``_weight_int8pack_mm``) has one scale per output row, so Q8_0's per-block scales are folded
into a per-row requantization, which adds at most half a step of the row's largest block scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_plugin_sdk import QuantizedWeight
from engine_plugin_sdk.grouped_codes import GroupedCodes, grouped_codes

GGUF_BLOCK = 32
#: GGUF type name -> bytes per block of 32 weights, for the types this module unpacks
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
#: torch's int4 packing tiles the input dimension; 2 is what its CPU kernel expects
INT4_INNER_K_TILES = 2
#: the int4 kernel's row count must be a multiple of this
INT4_ROW_MULTIPLE = 16


@dataclass(slots=True)
class Int4Blocks:
    """A 4-bit matrix in group-32 form: ``w = (q - 8) * scale + zero``.

    Attributes:
        q: uint8 ``[out, in]`` in 0..15.
        scale: float32 ``[out, in / 32]``.
        zero: float32 ``[out, in / 32]``.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dense(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight."""
        out, groups = self.scale.shape
        w = (self.q.view(out, groups, GGUF_BLOCK).float() - 8.0) * self.scale[..., None] + self.zero[
            ..., None
        ]
        return w.reshape(out, groups * GGUF_BLOCK)


def gguf_blocks(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> torch.Tensor:
    """View GGUF bytes ``[out, bytes_per_row]`` as ``[out, in / 32, block_bytes]``.

    Raises:
        ValueError: if the byte count does not match the shape, or the width is not whole blocks.
    """
    out, width = shape
    if width % GGUF_BLOCK:
        raise ValueError(
            f"GGUF {type_name} weight of width {width} is not a whole number of 32-weight blocks"
        )
    block_bytes = BLOCK_BYTES[type_name]
    groups = width // GGUF_BLOCK
    if data.dtype != torch.uint8 or data.numel() != out * groups * block_bytes:
        raise ValueError(
            f"GGUF {type_name} data of {data.numel()} {data.dtype} elements does not hold a {out}x{width} "
            f"matrix ({out * groups * block_bytes} bytes expected)"
        )
    return data.reshape(out, groups, block_bytes)


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, as float32 ``[out, groups]``."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> 32 values in 0..15, low nibbles first."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def unpack_q4(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> Int4Blocks:
    """Q4_0 or Q4_1 bytes as :class:`Int4Blocks`."""
    blocks = gguf_blocks(data, type_name, shape)
    d = _half(blocks, 0)
    if type_name == "Q4_0":
        zero = torch.zeros_like(d)
        qs = blocks[..., 2:18]
    else:
        # d*q + m == (q - 8)*d + (m + 8d)
        zero = _half(blocks, 2) + 8.0 * d
        qs = blocks[..., 4:20]
    q = nibbles(qs).reshape(shape[0], shape[1])
    return Int4Blocks(q.contiguous(), d, zero)


def unpack_q8_0(data: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Q8_0 bytes as the float32 ``[out, in]`` weight."""
    blocks = gguf_blocks(data, "Q8_0", shape)
    d = _half(blocks, 0)
    q = blocks[..., 2:34].contiguous().view(torch.int8).float()
    return (q * d[..., None]).reshape(shape)


def pack_int4(blocks: Int4Blocks, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack for ``_weight_int4pack_mm_for_cpu``: (packed weight, scales_and_zeros ``[in/32, out', 2]``).

    The kernel wants the row count a multiple of :data:`INT4_ROW_MULTIPLE`; extra rows (``out' > out``)
    are zero weights, and the caller slices them off the output.
    """
    q, scale, zero = blocks.q, blocks.scale, blocks.zero
    pad = -q.shape[0] % INT4_ROW_MULTIPLE
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad), value=8)
        scale = torch.nn.functional.pad(scale, (0, 0, 0, pad))
        zero = torch.nn.functional.pad(zero, (0, 0, 0, pad))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), INT4_INNER_K_TILES)
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
    return packed, scales_and_zeros


def requantize_int8_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 for ``_weight_int8pack_mm``: (int8 ``[out, in]``, scales ``[out]``)."""
    # round the scale to the kernel's dtype first, so that q * scale is what the kernel multiplies by
    scale = (weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0).to(dtype)
    q = torch.round(weight / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def gguf_codes(data: torch.Tensor, scheme: str, shape: tuple[int, int]) -> GroupedCodes:
    """GGUF bytes of ``scheme`` as one code per value and float32 group scales (the SDK's unpacking, bit for bit
    ``gguf.quants``' values).

    Raises:
        ValueError: for bytes that do not match the shape, or a scheme without that form.
    """
    return grouped_codes(QuantizedWeight(scheme, data, shape, None, {}), torch.device("cpu"))


def codes_as_q8_0(data: torch.Tensor, scheme: str, shape: tuple[int, int]) -> torch.Tensor:
    """GGUF bytes whose codes less their zero point fit int8 with one scale per 32 values (Q5_0, IQ4_NL, IQ4_XS) as
    Q8_0 bytes of the same matrix: ``(q - zero_point) * d`` is a Q8_0 block's ``d * q8``. Exact where ``d`` is an fp16
    value (Q5_0's, IQ4_NL's); IQ4_XS's ``d * (ls - 32)`` rounds to fp16 (2^-11 relative at most, as the K-quants'
    ``d * sc`` do on the C kernels).

    Raises:
        ValueError: for bytes that do not match the shape.
    """
    codes = gguf_codes(data, scheme, shape)
    q8 = (codes.codes.to(torch.int16) - codes.zero_point).to(torch.int8).reshape(shape[0], -1, GGUF_BLOCK)
    d = codes.scales.to(torch.float16).unsqueeze(-1).view(torch.uint8)
    return torch.cat([d, q8.view(torch.uint8)], dim=-1).reshape(shape[0], -1).contiguous()

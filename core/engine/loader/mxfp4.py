"""MXFP4 (the OCP microscaling FP4 format gpt-oss ships its experts in), dequantized at load.

Each row of a matrix is cut into blocks of 32 values; a block is 16 bytes of FP4 (E2M1) values, two a byte
with the low nibble first, and one shared power-of-two scale byte (E8M0: ``2 ** (byte - 127)``).
"""

from __future__ import annotations

import torch

#: the 16 E2M1 codes' values (sign bit last)
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: values per block (one scale each)
MXFP4_BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The matrices MXFP4 blocks and scales stand for.

    Args:
        blocks: uint8 ``[..., rows, in / 32, 16]``.
        scales: uint8 ``[..., rows, in / 32]``.
        dtype: the result's dtype (every MXFP4 value is exact in bfloat16 and wider while its scale is).

    Returns:
        ``[..., rows, in]`` in ``dtype``.

    Raises:
        ValueError: the shapes do not belong together.
    """
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    packed = blocks.to(torch.uint8)
    low, high = table[(packed & 0x0F).long()], table[(packed >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., rows, groups, 32]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype)


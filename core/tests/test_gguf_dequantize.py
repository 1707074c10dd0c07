"""The loader's GGUF dequantization: the eight types with a grouped-integer form unpack in torch to the same
bits as ``gguf.quants`` (the reference the SDK's test weights dequantize through); other types go through
``gguf.quants`` itself."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from engine.loader.grouped_codes import GGUF_GROUPED_FORMS
from engine.loader.quantized import dequantize_gguf_bytes, make_gguf_weight
from engine_plugin_sdk.quant import make_quantized_weight


def fresh_seed() -> int:
    return int(torch.randint(0, 1 << 30, ()))


@pytest.mark.parametrize("scheme", [*sorted(GGUF_GROUPED_FORMS), "gguf_q3_k"])
def test_a_gguf_weight_dequantizes_to_the_references_bits(scheme: str) -> None:
    reference_weight = make_quantized_weight(scheme, 40, 512, seed=fresh_seed())
    qtype = GGMLQuantizationType[scheme.removeprefix("gguf_").upper()]
    weight = make_gguf_weight(reference_weight.data, qtype, (40, 512))
    got = weight.dequantize()
    assert got.dtype == torch.float32 and got.shape == (40, 512)
    assert torch.equal(got, reference_weight.dequantize()), scheme


def test_q5_codes_take_their_high_bit_from_its_own_field() -> None:
    """Q5_0's value ``i`` takes bit ``i`` of the block's little-endian 32-bit ``qh``; Q5_K's value ``j`` of
    sub-block ``i`` bit ``i`` of byte ``j`` of its 32 bytes: with every low nibble 0 and one high bit set, one
    value is 16 steps up and the others not."""
    from engine.loader.grouped_codes import grouped_codes

    q5_0 = make_quantized_weight("gguf_q5_0", 1, 32, seed=fresh_seed())
    q5_0.data[0, 2:22] = 0
    q5_0.data[0, 4] = 0x08  # byte 2 of qh, bit 3: value 19
    assert grouped_codes(q5_0, torch.device("cpu")).codes[0].nonzero().flatten().tolist() == [19]
    q5_k = make_quantized_weight("gguf_q5_k", 1, 256, seed=fresh_seed())
    q5_k.data[0, 16:176] = 0
    q5_k.data[0, 16 + 5] = 0x04  # byte 5 of qh, bit 2: value 5 of sub-block 2
    assert grouped_codes(q5_k, torch.device("cpu")).codes[0].nonzero().flatten().tolist() == [2 * 32 + 5]
    for weight in (q5_0, q5_k):
        assert torch.equal(dequantize_gguf_bytes(weight.data, GGMLQuantizationType[weight.scheme[5:].upper()],
                                                 tuple(weight.shape)), weight.dequantize())  # fmt: skip


def test_blocks_of_a_higher_rank_tensor_keep_its_shape() -> None:
    """A stacked-experts tensor ``[experts, out, in]`` whose rows are runs of blocks."""
    reference_weight = make_quantized_weight("gguf_q4_k", 3 * 8, 256, seed=fresh_seed())
    got = dequantize_gguf_bytes(reference_weight.data.reshape(3, 8, -1), GGMLQuantizationType.Q4_K, (3, 8, 256))
    assert torch.equal(got, reference_weight.dequantize().reshape(3, 8, 256))

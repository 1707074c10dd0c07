"""The loader's GGUF dequantization: the types with a grouped-integer form unpack in torch to the same bits as
``gguf.quants`` (the reference the SDK's test weights dequantize through); other types go through ``gguf.quants``
itself, and a type neither handles is a one-line load error."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from engine.loader.grouped_codes import GGUF_GROUPED_FORMS
from engine.loader.quantized import dequantize_gguf_bytes, make_gguf_weight
from engine_plugin_sdk.quant import make_quantized_weight


def fresh_seed() -> int:
    return int(torch.randint(0, 1 << 30, ()))


@pytest.mark.parametrize("scheme", sorted(GGUF_GROUPED_FORMS))
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


def test_q3_k_codes_take_their_bits_from_their_own_fields() -> None:
    """Q3_K's value ``128 h + 32 j + l`` takes bits ``2 j`` of quant byte ``32 h + l`` and bit ``4 h + j`` of high-mask
    byte ``l``: with every other bit clear, one value is 4 steps up (its high bit) and another 2 (its quant)."""
    from engine.loader.grouped_codes import grouped_codes

    weight = make_quantized_weight("gguf_q3_k", 1, 256, seed=fresh_seed())
    weight.data[0, 0:96] = 0
    weight.data[0, 5] = 1 << 6  # high bit 6 of byte 5: value 32 * 6 + 5
    weight.data[0, 32 + 32 + 7] = 0b10 << 2  # quant byte 32 + 7, bits 2-3: value 128 + 32 + 7
    codes = grouped_codes(weight, torch.device("cpu")).codes[0]
    assert codes.nonzero().flatten().tolist() == [167, 197]
    assert codes[167].item() == 2 and codes[197].item() == 4


def test_a_type_the_loader_cannot_read_is_a_one_line_error(tmp_path) -> None:
    from gguf_test_models import write_tiny_llama_gguf

    from engine.loader.errors import ModelLoadError
    from engine.loader.gguf_file import load_gguf_config

    path = tmp_path / "tiny-tq1_0.gguf"
    write_tiny_llama_gguf(path, "gguf_tq1_0")
    with pytest.raises(ModelLoadError, match="has GGUF type TQ1_0, which the loader cannot dequantise") as err:
        load_gguf_config(str(path))
    assert "\n" not in str(err.value) and "IQ4_XS" in str(err.value)

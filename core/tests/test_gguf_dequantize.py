"""The loader's GGUF dequantization: the five types with a grouped-integer form unpack in torch to the same
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


@pytest.mark.parametrize("scheme", [*sorted(GGUF_GROUPED_FORMS), "gguf_q5_0", "gguf_q5_1"])
def test_a_gguf_weight_dequantizes_to_the_references_bits(scheme: str) -> None:
    reference_weight = make_quantized_weight(scheme, 40, 512, seed=fresh_seed())
    qtype = GGMLQuantizationType[scheme.removeprefix("gguf_").upper()]
    weight = make_gguf_weight(reference_weight.data, qtype, (40, 512))
    got = weight.dequantize()
    assert got.dtype == torch.float32 and got.shape == (40, 512)
    assert torch.equal(got, reference_weight.dequantize()), scheme


def test_blocks_of_a_higher_rank_tensor_keep_its_shape() -> None:
    """A stacked-experts tensor ``[experts, out, in]`` whose rows are runs of blocks."""
    reference_weight = make_quantized_weight("gguf_q4_k", 3 * 8, 256, seed=fresh_seed())
    got = dequantize_gguf_bytes(reference_weight.data.reshape(3, 8, -1), GGMLQuantizationType.Q4_K, (3, 8, 256))
    assert torch.equal(got, reference_weight.dequantize().reshape(3, 8, 256))

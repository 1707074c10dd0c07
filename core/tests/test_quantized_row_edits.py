"""The loader's row edits of quantized weights (fused q/k/v stacking, the rotary un-permutation) stay
quantized and dequantize to the same edit of the dense weight (moved here from the CPU plugin's tests)."""

from __future__ import annotations

import pytest
import torch

from engine.loader.quantized import concat_rows, map_rows
from engine_plugin_sdk.quant import make_quantized_weight


@pytest.mark.parametrize("scheme", ["gguf_q4_1", "gguf_q8_0", "int8"])
def test_row_edits_stay_quantized_and_match_dense(scheme: str) -> None:
    a = make_quantized_weight(scheme, 48, 64, seed=1)
    b = make_quantized_weight(scheme, 16, 64, seed=2)
    stacked = concat_rows([a, b])
    assert stacked.shape == (64, 64) and stacked.scheme == scheme
    torch.testing.assert_close(
        stacked.dequantize(), torch.cat([a.dequantize(), b.dequantize()]), atol=0, rtol=0
    )
    flip = map_rows(stacked, lambda t: t.flip(0))
    assert flip.scheme == scheme
    torch.testing.assert_close(flip.dequantize(), stacked.dequantize().flip(0), atol=0, rtol=0)


def test_weights_of_different_schemes_are_not_stacked() -> None:
    a = make_quantized_weight("gguf_q4_1", 48, 64, seed=1)
    with pytest.raises(ValueError, match="cannot stack"):
        concat_rows([a, make_quantized_weight("gguf_q8_0", 16, 64)])


#: scheme -> (rows stay quantized, block-aligned columns stay quantized)
SLICES = {
    "gguf_q4_1": (True, True), "gguf_q8_0": (True, True), "gguf_q4_k": (True, True), "int8": (False, False),
    # GPTQ's act order: any rows, but a run of input columns is scattered over the stored ones
    "int4_grouped": (True, False), "int4_grouped_in_order": (True, True), "int8_grouped_in_order": (True, True),
}  # fmt: skip


def _weight(scheme: str, out_features: int, in_features: int, seed: int):
    if not scheme.endswith("_in_order"):
        return make_quantized_weight(scheme, out_features, in_features, seed=seed)
    from engine.interfaces.grouped_int import grouped_int_weight

    bits = 4 if scheme.startswith("int4") else 8
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (out_features, in_features), generator=gen)
    scales = torch.rand(out_features, in_features // 128, generator=gen) + 0.1
    zeros = torch.randint(0, 2**bits, scales.shape, generator=gen).float()
    return grouped_int_weight(codes, scales, zeros, 128, bits)


@pytest.mark.parametrize("scheme", list(SLICES))
def test_a_ranks_slices_stay_quantized_on_block_boundaries(scheme: str) -> None:
    from engine.interfaces.gemm import QuantizedWeight
    from engine.loader.weight_slices import weight_columns, weight_rows

    weight = _weight(scheme, 64, 512, seed=3)
    full = weight.dequantize()
    rows = weight_rows(weight, slice(16, 48))
    columns = weight_columns(weight, slice(256, 512))  # on the blocks of every GGUF scheme (32 or 256)
    unaligned = weight_columns(weight, slice(16, 48))  # inside a block: dequantized first
    rows_kept, columns_kept = SLICES[scheme]
    assert isinstance(rows, QuantizedWeight) == rows_kept and isinstance(columns, QuantizedWeight) == columns_kept
    assert isinstance(unaligned, torch.Tensor)
    # a rank that holds the whole weight (no split) holds it as it is
    assert weight_rows(weight, slice(0, 64)) is weight and weight_columns(weight, slice(0, 512)) is weight
    for got, want in ((rows, full[16:48]), (columns, full[:, 256:]), (unaligned, full[:, 16:48])):
        got = got.dequantize() if isinstance(got, QuantizedWeight) else got
        torch.testing.assert_close(got, want, atol=0, rtol=0)

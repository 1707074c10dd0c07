"""Packed GGUF weights (Q4_0, Q4_1, Q8_0) against the float64 product with the dequantised weight."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine_plugin_cpu import gemm as gemm_module
from engine_plugin_cpu.gemm import (
    INT4_MAX_PACKED_ROWS,
    INT8_MAX_PACKED_ROWS,
    SINGLE_THREAD_MAX_ROWS,
    CpuGemmBackend,
    PackedWeight,
    dense_linear,
    prepack_dense,
)
from engine_plugin_cpu.quant_pack import unpack_q4, unpack_q8_0
from engine_plugin_sdk import QuantizedWeight
from engine_plugin_sdk.quant import make_quantized_weight

SCHEMES = ["gguf_q4_0", "gguf_q4_1", "gguf_q8_0"]
# bf16 activations and bf16 scales: about 3 significant digits; relative to the output's largest entry
BF16_REL_TOL = 2e-2
# row counts on both sides of each kernel's packed/dense switch
ROW_COUNTS = sorted(
    {1, INT8_MAX_PACKED_ROWS, INT8_MAX_PACKED_ROWS + 1, INT4_MAX_PACKED_ROWS, INT4_MAX_PACKED_ROWS + 1, 40}
)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", [(96, 256), (100, 64), (7, 32)])
def test_unpack_matches_gguf_dequantize(scheme: str, shape: tuple[int, int]) -> None:
    weight = make_quantized_weight(scheme, *shape, seed=5)
    if scheme == "gguf_q8_0":
        dense = unpack_q8_0(weight.data, shape)
    else:
        dense = unpack_q4(weight.data, scheme[len("gguf_") :].upper(), shape).dense()
    torch.testing.assert_close(dense, weight.dequantize(), atol=0, rtol=0)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dense_copy", [True, False])
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_packed_linear_against_float64(scheme: str, dense_copy: bool, rows: int) -> None:
    out_features = 100  # not a multiple of 16: the int4 kernel's padded rows must be sliced off
    weight = make_quantized_weight(scheme, out_features, 256, seed=rows)
    gemm = CpuGemmBackend(dense_copy=dense_copy)
    prepared = gemm.prepare_weight(weight, torch.bfloat16)
    assert isinstance(prepared, PackedWeight) and (prepared.dense is not None) == dense_copy
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    expected = x.double() @ weight.dequantize().double().T + bias.double()
    for inputs in (x, x.reshape(1, rows, 256)):
        out = gemm.linear(inputs, prepared, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (*inputs.shape[:-1], out_features)
        err = (out.double().reshape(rows, -1) - expected).abs().max().item()
        assert err <= BF16_REL_TOL * expected.abs().max().item(), f"{scheme} rows={rows}: error {err}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_float32_model_dequantizes_exactly(scheme: str) -> None:
    weight = make_quantized_weight(scheme, 32, 64, seed=9)
    prepared = CpuGemmBackend().prepare_weight(weight, torch.float32)
    assert isinstance(prepared, torch.Tensor) and prepared.dtype == torch.float32
    assert torch.equal(prepared, weight.dequantize())


def test_packed_weight_refuses_float32_activations() -> None:
    gemm = CpuGemmBackend()
    prepared = gemm.prepare_weight(make_quantized_weight("gguf_q4_0", 32, 64), torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 activations"):
        gemm.linear(torch.randn(1, 64), prepared)


def rows_edited(weights: list[QuantizedWeight], rows_fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
    """GGUF weights stacked by rows, then rows reordered, on the block bytes themselves: what the loader
    hands the GEMM for a fused q/k/v projection (whose loader-side edits core/tests checks)."""
    first = weights[0]
    data = rows_fn(torch.cat([w.data for w in weights]))
    shape = (sum(w.shape[0] for w in weights), first.shape[1])

    def dequantize() -> torch.Tensor:
        return rows_fn(torch.cat([w.dequantize() for w in weights]))

    return QuantizedWeight(first.scheme, data, shape, dequantize, dict(first.extra))


def test_row_edited_weights_stay_packed_and_match_dense() -> None:
    a = make_quantized_weight("gguf_q4_1", 48, 64, seed=1)
    b = make_quantized_weight("gguf_q4_1", 16, 64, seed=2)
    flip = rows_edited([a, b], lambda t: t.flip(0))
    packed = CpuGemmBackend(dense_copy=False).prepare_weight(flip, torch.bfloat16)
    assert isinstance(packed, PackedWeight)
    x = torch.randn(1, 64).to(torch.bfloat16)
    expected = x.double() @ flip.dequantize().double().T
    assert (
        CpuGemmBackend().linear(x, packed).double() - expected
    ).abs().max() <= BF16_REL_TOL * expected.abs().max()


def test_prepacked_dense_copy_is_bit_identical_to_linear() -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    weight = torch.randn(100, 256, generator=gen).to(torch.bfloat16)
    packed = prepack_dense(weight)
    for rows in (1, 13, 40):
        x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
        assert torch.equal(dense_linear(x, packed, None), torch.nn.functional.linear(x, weight))


def test_plain_bf16_weights_are_prepacked_and_multiply_bit_identically(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense bf16 weight is kept in oneDNN's layout (with its bias fused into the product); float32
    weights, weights above the size limit and a backend without prepacking keep the plain tensor."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    weight, bias = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen).to(torch.bfloat16)
    backend = CpuGemmBackend()
    prepared = backend.prepare_weight(weight, torch.bfloat16)
    if torch.backends.mkldnn.is_available():
        assert prepared.is_mkldnn
    plain = weight.to(torch.bfloat16)
    for rows in (1, 7, 300):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        assert torch.equal(backend.linear(x, prepared, bias), torch.nn.functional.linear(x, plain, bias))
    assert not backend.prepare_weight(weight, torch.float32).is_mkldnn
    assert not CpuGemmBackend(prepack=False).prepare_weight(weight, torch.bfloat16).is_mkldnn
    monkeypatch.setattr(gemm_module, "PREPACK_MAX_ELEMENTS", 96 * 128 - 1)
    assert not backend.prepare_weight(weight, torch.bfloat16).is_mkldnn


def test_small_batches_run_single_threaded_and_restore_the_pool() -> None:
    original = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gemm = CpuGemmBackend()
        prepared = gemm.prepare_weight(make_quantized_weight("gguf_q4_1", 64, 128, seed=3), torch.bfloat16)
        seen: list[int] = []
        real = torch.ops.aten._weight_int4pack_mm_for_cpu

        def spy(*args: object) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return real(*args)

        torch.ops.aten._weight_int4pack_mm_for_cpu = spy  # type: ignore[assignment]
        try:
            for rows in (1, SINGLE_THREAD_MAX_ROWS + 1):
                gemm.linear(torch.randn(rows, 128).to(torch.bfloat16), prepared)
            # a weight above the size limit (the lm_head's case) keeps every thread even for one row
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(gemm_module, "SINGLE_THREAD_MAX_ELEMENTS", 64 * 128 - 1)
                gemm.linear(torch.randn(1, 128).to(torch.bfloat16), prepared)
        finally:
            torch.ops.aten._weight_int4pack_mm_for_cpu = real  # type: ignore[assignment]
        assert seen == [1, 2, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(original)

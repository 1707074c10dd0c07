"""The FP8 e4m3fnuz path, the dense GEMM and the CDNA launch table, on the CPU."""

from __future__ import annotations

import pytest
import torch

from engine_plugin_amd.gemm import Fp8Weight, RocmGemmBackend, e4m3fn_to_fnuz
from engine_plugin_amd.tuning import base_arch, fp8_dtype_name, tuning_for_arch, wavefront_size
from engine_plugin_sdk.quant import make_quantized_weight
from engine_plugin_sdk.reference_ops import ref_linear, ref_quantized_linear
from engine_plugin_sdk.tolerances import compare, get_tolerance


def test_fn_to_fnuz_is_exact_for_every_bit_pattern() -> None:
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    fn = bits.view(torch.float8_e4m3fn)
    finite = torch.isfinite(fn.float())
    scale = torch.rand(256, generator=torch.Generator().manual_seed(1)) + 0.5
    fnuz, fnuz_scale = e4m3fn_to_fnuz(fn, scale)
    assert fnuz.dtype == torch.float8_e4m3fnuz
    want = (fn.float() * scale)[finite]
    got = (fnuz.float() * fnuz_scale)[finite]
    assert torch.equal(got, want)
    assert not torch.isnan(fnuz.float()[finite]).any()  # 0x80 (negative zero) must not become NaN


@pytest.mark.parametrize("fp8_dtype", ["float8_e4m3fnuz", "float8_e4m3fn"])
def test_fp8_and_dense_linear_match_reference(fp8_dtype: str) -> None:
    gemm = RocmGemmBackend("cpu", fp8_dtype=fp8_dtype)
    assert gemm.supported_quant_schemes == frozenset({"fp8_e4m3"})
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(2, 5, 128, generator=gen).to(dtype)
        bias = torch.randn(64, generator=gen).to(dtype)
        w = (torch.randn(64, 128, generator=gen) / 8).to(dtype)
        assert not compare(gemm.linear(x, gemm.prepare_weight(w, dtype), bias), ref_linear(x, w, bias), get_tolerance(dtype), "dense")
        qw = make_quantized_weight("fp8_e4m3", 64, 128, seed=11)
        prepared = gemm.prepare_weight(qw, dtype)
        assert isinstance(prepared, Fp8Weight) and str(prepared.data.dtype) == f"torch.{fp8_dtype}"
        got = gemm.linear(x, prepared, bias)
        assert got.dtype == dtype
        assert not compare(got, ref_quantized_linear(x, qw, bias), get_tolerance(dtype, quantized=True), fp8_dtype)


def test_without_fp8_units_weights_are_dequantized_and_bad_input_is_refused() -> None:
    gemm = RocmGemmBackend("cpu")
    assert not gemm.supported_quant_schemes
    prepared = gemm.prepare_weight(make_quantized_weight("fp8_e4m3", 32, 64), torch.float32)
    assert isinstance(prepared, torch.Tensor) and prepared.dtype == torch.float32
    with pytest.raises(ValueError, match="expected a float tensor"):
        gemm.prepare_weight(torch.ones(4, 4, dtype=torch.int32), torch.float32)
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        RocmGemmBackend("cpu", fp8_dtype="float8_e5m2")


def test_launch_table_per_architecture() -> None:
    assert base_arch("gfx942:sramecc+:xnack-") == "gfx942"
    assert wavefront_size("gfx90a") == 64 and wavefront_size("gfx1100") == 32
    assert fp8_dtype_name("gfx942") == "float8_e4m3fnuz" and fp8_dtype_name("gfx90a") is None
    mi300 = tuning_for_arch("gfx942", 304)
    mi250 = tuning_for_arch("gfx90a", 110)
    rdna = tuning_for_arch("gfx1100", 96)
    assert mi300.prefill_tiles(128).block_m > mi250.prefill_tiles(128).block_m
    assert rdna.decode_block_n < mi300.decode_block_n
    for tuning in (mi300, mi250, rdna):
        # the AMD stream pipeliner takes at most two stages
        assert tuning.decode_num_stages <= 2 and tuning.prefill_tiles(256).num_stages <= 2
    # 304 CUs want more context splits for a small batch than 110 do
    assert mi300.decode_splits(1, 8, None) >= mi250.decode_splits(1, 8, None)

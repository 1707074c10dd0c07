"""GEMM against the float64 reference, for every claimed dtype and quantization scheme."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import assert_close, torch_dtype
from engine_conformance.pytest_plugin import not_claimed, not_runnable
from engine_plugin_sdk.quant import UnknownSchemeError, make_quantized_weight
from engine_plugin_sdk.reference_ops import ref_linear, ref_quantized_linear
from engine_plugin_sdk.tolerances import get_tolerance

IN_FEATURES = 256
OUT_FEATURES = 96


def random_inputs(
    seed: int, dtype: torch.dtype, device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # scaled so that outputs are of order one and the tolerance table applies as written
    x = torch.randn(2, 5, IN_FEATURES, generator=gen).to(dtype).to(device)
    weight = (torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen) * IN_FEATURES**-0.5).to(dtype).to(device)
    bias = torch.randn(OUT_FEATURES, generator=gen).to(dtype).to(device)
    return x, weight, bias


def check_output(out: Any, expected: torch.Tensor, x: torch.Tensor, tol: Any, capability: str) -> None:
    if out.dtype != x.dtype:
        pytest.fail(f"{capability}: output dtype {out.dtype}, expected the input's {x.dtype}", pytrace=False)
    assert_close(out, expected, tol, capability)


@pytest.mark.capability("gemm.{dtype_name}")
def test_dense_linear(platform: Platform, device: Any, dtype_name: str) -> None:
    capability = f"gemm.{dtype_name}"
    dtype = torch_dtype(dtype_name)
    gemm = platform.make_gemm_backend()
    x, weight, bias = random_inputs(51, dtype, device)
    prepared = gemm.prepare_weight(weight, dtype)
    tol = get_tolerance(dtype)
    check_output(
        gemm.linear(x, prepared, bias), ref_linear(x, weight, bias), x, tol, f"{capability} with bias"
    )
    check_output(gemm.linear(x, prepared), ref_linear(x, weight), x, tol, f"{capability} without bias")
    flat = x.reshape(-1, IN_FEATURES)
    check_output(
        gemm.linear(flat, prepared, bias),
        ref_linear(flat, weight, bias),
        flat,
        tol,
        f"{capability} 2-D input",
    )


@pytest.mark.capability("gemm.quant.{quant_scheme}")
def test_quantized_linear(platform: Platform, caps: Capabilities, device: Any, quant_scheme: str) -> None:
    if quant_scheme == "any":
        not_claimed("no quantization schemes are claimed (weights are dequantized at load)")
    capability = f"gemm.quant.{quant_scheme}"
    gemm = platform.make_gemm_backend()
    if quant_scheme not in gemm.supported_quant_schemes:
        pytest.fail(
            f"{capability}: claimed by the platform, but the GEMM backend's supported_quant_schemes "
            f"{sorted(gemm.supported_quant_schemes)} lacks it",
            pytrace=False,
        )
    try:
        weight = make_quantized_weight(quant_scheme, OUT_FEATURES, IN_FEATURES, seed=61, device=device)
    except UnknownSchemeError as exc:
        not_runnable(str(exc))
    for dtype_name in caps.dtypes:
        dtype = torch_dtype(dtype_name)
        x, _, bias = random_inputs(62, dtype, device)
        try:
            prepared = gemm.prepare_weight(weight, dtype)
        except (ValueError, NotImplementedError, TypeError) as exc:
            pytest.fail(
                f"{capability}: claimed, but prepare_weight refused it in {dtype_name}: {type(exc).__name__}: {exc}",
                pytrace=False,
            )
        tol = get_tolerance(dtype, quantized=True)
        expected = ref_quantized_linear(x, weight, bias)
        check_output(gemm.linear(x, prepared, bias), expected, x, tol, f"{capability} {dtype_name} with bias")
        check_output(
            gemm.linear(x, prepared), ref_quantized_linear(x, weight), x, tol, f"{capability} {dtype_name}"
        )

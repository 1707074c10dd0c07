"""GEMM against the float64 reference, for every claimed dtype and quantization scheme."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import assert_close, torch_dtype
from engine_conformance.pytest_plugin import not_claimed, not_runnable
from engine_plugin_sdk.quant import UnknownSchemeError, make_quantized_weight
from engine_plugin_sdk.reference_ops import (
    ref_add_rms_norm_linear,
    ref_add_rms_norm_router,
    ref_dequantize,
    ref_gated_linear,
    ref_linear,
    ref_linear_activation,
    ref_quantized_linear,
)
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


#: a small model's MLP projection: neither width a power of two
SHAPE_K, SHAPE_N = 576, 1536
#: a decode row, a few, just over a 32-row tile, a prefill chunk
SHAPE_ROWS = (1, 7, 33, 100)
#: a 7B-class hidden size and a slice of its projection, for the quantized kernels
QUANT_K, QUANT_N = 4096, 512
#: rows around the packed kernels' crossovers to their dense copies (CPU: 2 / 12 / 24 / 32 rows)
QUANT_ROWS = (1, 7, 33)


def strided_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [rows, k]`` as a view into wider rows at an offset (a slice of a fused output)."""
    buf = torch.zeros(x.shape[0], x.shape[1] + 24, dtype=x.dtype, device=x.device)
    view = buf[:, 8 : 8 + x.shape[1]]
    view.copy_(x)
    return view


@pytest.mark.capability("gemm.{dtype_name}.shapes")
def test_dense_linear_shapes(platform: Platform, device: Any, dtype_name: str) -> None:
    """K=576, N=1536 at 1, 7, 33 and 100 rows, contiguous and as a strided view."""
    capability = f"gemm.{dtype_name}.shapes"
    dtype = torch_dtype(dtype_name)
    gemm = platform.make_gemm_backend()
    gen = torch.Generator().manual_seed(53)
    weight = (torch.randn(SHAPE_N, SHAPE_K, generator=gen) * SHAPE_K**-0.5).to(dtype).to(device)
    bias = torch.randn(SHAPE_N, generator=gen).to(dtype).to(device)
    prepared = gemm.prepare_weight(weight, dtype)
    tol = get_tolerance(dtype)
    for rows in SHAPE_ROWS:
        x = torch.randn(rows, SHAPE_K, generator=gen).to(dtype).to(device)
        expected = ref_linear(x, weight, bias)
        check_output(gemm.linear(x, prepared, bias), expected, x, tol, f"{capability} M={rows}")
        view = strided_rows(x)
        check_output(
            gemm.linear(view, prepared, bias), expected, x, tol, f"{capability} M={rows} strided view"
        )


@pytest.mark.capability("gemm.quant.{quant_scheme}.shapes")
def test_quantized_linear_shapes(
    platform: Platform, caps: Capabilities, device: Any, quant_scheme: str
) -> None:
    """A claimed scheme at K=4096, N=512 and 1, 7 and 33 rows, in every claimed dtype."""
    if quant_scheme == "any":
        not_claimed("no quantization schemes are claimed (weights are dequantized at load)")
    capability = f"gemm.quant.{quant_scheme}.shapes"
    gemm = platform.make_gemm_backend()
    if quant_scheme not in gemm.supported_quant_schemes:
        pytest.fail(f"{capability}: claimed, but supported_quant_schemes lacks it", pytrace=False)
    try:
        weight = make_quantized_weight(quant_scheme, QUANT_N, QUANT_K, seed=63, device=device)
    except UnknownSchemeError as exc:
        not_runnable(str(exc))
    gen = torch.Generator().manual_seed(64)
    for dtype_name in caps.dtypes:
        dtype = torch_dtype(dtype_name)
        prepared = gemm.prepare_weight(weight, dtype)
        tol = get_tolerance(dtype, quantized=True)
        for rows in QUANT_ROWS:
            x = torch.randn(rows, QUANT_K, generator=gen).to(dtype).to(device)
            label = f"{capability} {dtype_name} M={rows}"
            check_output(gemm.linear(x, prepared), ref_quantized_linear(x, weight), x, tol, label)


#: a gated MLP's widths: 2 x 200 gate/up rows (not a multiple of any row tile) over K=576
GATED_K, GATED_D = 576, 200


@pytest.mark.capability("gemm.gated_linear.{dtype_name}")
def test_gated_linear(platform: Platform, device: Any, dtype_name: str) -> None:
    """``gated_linear`` for each activation the backend claims, at 1, 7 and 33 rows (one row is the
    fused batch-1 GEMV on GPUs), contiguous and as a strided view, against the float64 product and
    activation."""
    capability = f"gemm.gated_linear.{dtype_name}"
    gemm = platform.make_gemm_backend()
    if not gemm.gated_activations:
        not_claimed("the GEMM backend fuses no gated activation (the core runs linear and the activation op)")
    dtype = torch_dtype(dtype_name)
    gen = torch.Generator().manual_seed(67)
    weight = (torch.randn(2 * GATED_D, GATED_K, generator=gen) * GATED_K**-0.5).to(dtype).to(device)
    prepared = gemm.prepare_weight(weight, dtype)
    tol = get_tolerance(dtype)
    for activation in sorted(gemm.gated_activations):
        for rows in QUANT_ROWS:
            x = torch.randn(rows, GATED_K, generator=gen).to(dtype).to(device)
            expected = ref_gated_linear(x, weight, activation)
            label = f"{capability} {activation} M={rows}"
            check_output(gemm.gated_linear(x, prepared, activation), expected, x, tol, label)
            check_output(gemm.gated_linear(strided_rows(x), prepared, activation), expected, x, tol, f"{label} strided view")


@pytest.mark.capability("gemm.quant.{quant_scheme}.gated")
def test_quantized_gated_linear(platform: Platform, caps: Capabilities, device: Any, quant_scheme: str) -> None:
    """``gated_linear`` over a quantized weight stacking 200 gate rows over 200 up rows (K=512), for each
    activation the backend claims, at 1, 7 and 33 rows in each claimed dtype (a GPU's few-row kernel applies
    the activation in its own epilogue), against the float64 product of the dequantized weight."""
    if quant_scheme == "any":
        not_claimed("no quantization schemes are claimed (weights are dequantized at load)")
    capability = f"gemm.quant.{quant_scheme}.gated"
    gemm = platform.make_gemm_backend()
    if not gemm.gated_activations:
        not_claimed("the GEMM backend fuses no gated activation (the core runs linear and the activation op)")
    try:
        weight = make_quantized_weight(quant_scheme, 2 * GATED_D, 512, seed=71, device=device)
    except UnknownSchemeError as exc:
        not_runnable(str(exc))
    dense = ref_dequantize(weight)
    gen = torch.Generator().manual_seed(72)
    for dtype_name in caps.dtypes:
        dtype = torch_dtype(dtype_name)
        prepared = gemm.prepare_weight(weight, dtype)
        tol = get_tolerance(dtype, quantized=True)
        for activation in sorted(gemm.gated_activations):
            for rows in QUANT_ROWS:
                # products of order one, as for the dense rows (the test weights are not scaled down): the
                # gate's and up's roundings multiply, and a large up would magnify the gate's
                x = (torch.randn(rows, 512, generator=gen) / 4).to(dtype).to(device)
                label = f"{capability} {dtype_name} {activation} M={rows}"
                check_output(gemm.gated_linear(x, prepared, activation), ref_gated_linear(x, dense, activation), x,
                             tol, label)  # fmt: skip


#: an encoder MLP's up projection, narrowed: 300 outputs (not a multiple of a row tile) over K=192
ACTIVATION_K, ACTIVATION_N = 192, 300


@pytest.mark.capability("gemm.linear_activation.{dtype_name}")
def test_linear_activation(platform: Platform, device: Any, dtype_name: str) -> None:
    """``linear_activation`` for each activation the backend claims, with and without a bias, at 1, 7 and
    33 rows, contiguous and as a strided view, against the float64 product and activation."""
    capability = f"gemm.linear_activation.{dtype_name}"
    gemm = platform.make_gemm_backend()
    if not gemm.fused_activations:
        not_claimed("the GEMM backend fuses no activation into linear (the core runs linear and the activation op)")
    dtype = torch_dtype(dtype_name)
    gen = torch.Generator().manual_seed(71)
    weight = (torch.randn(ACTIVATION_N, ACTIVATION_K, generator=gen) * ACTIVATION_K**-0.5).to(dtype).to(device)
    bias = torch.randn(ACTIVATION_N, generator=gen).to(dtype).to(device)
    prepared = gemm.prepare_weight(weight, dtype)
    tol = get_tolerance(dtype)
    for activation in sorted(gemm.fused_activations):
        for rows in QUANT_ROWS:
            for b in (bias, None):
                x = torch.randn(rows, ACTIVATION_K, generator=gen).to(dtype).to(device)
                expected = ref_linear_activation(x, weight, b, activation)
                label = f"{capability} {activation} M={rows} bias={b is not None}"
                check_output(gemm.linear_activation(x, prepared, b, activation), expected, x, tol, label)
                strided = gemm.linear_activation(strided_rows(x), prepared, b, activation)
                check_output(strided, expected, x, tol, f"{label} strided view")


#: a layer's widths for the residual norm: K=1024 (a single step of the GPU's one-row GEMV at 1 warp, 4-bit),
#: 2 x 100 gate/up rows
NORM_K, NORM_D = 1024, 100


def _norm_inputs(rows: int, dtype: Any, device: Any, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(rows, NORM_K, generator=gen).to(dtype).to(device)
    residual = (torch.randn(rows, NORM_K, generator=gen) * 4).to(dtype).to(device)
    norm_weight = (torch.rand(NORM_K, generator=gen) + 0.5).to(dtype).to(device)
    return x, residual, norm_weight


def _check_norm_linear(gemm: Any, prepared: Any, dense: torch.Tensor, dtype: Any, device: Any, tol: Any,
                       label: str, gen: torch.Generator, rows_list: tuple[int, ...],
                       activations: list[str | None]) -> None:  # fmt: skip
    """``add_rms_norm_linear`` plain (with a bias) or gated by ``activations``, at ``rows_list`` rows."""
    bias = torch.randn(dense.shape[0], generator=gen).to(dtype).to(device)
    for rows in rows_list:
        for activation in activations:
            x, residual, norm_weight = _norm_inputs(rows, dtype, device, gen)
            b = bias if activation is None else None
            out, summed = gemm.add_rms_norm_linear(x, residual, norm_weight, 1e-5, prepared, b, activation)
            want, want_summed = ref_add_rms_norm_linear(x, residual, norm_weight, 1e-5, dense, b, activation)
            name = f"{label} {activation or 'plain'} M={rows}"
            check_output(summed, want_summed, x, tol, f"{name} sum")
            check_output(out, want, x, tol, name)


@pytest.mark.capability("gemm.add_rms_norm_linear.{dtype_name}")
def test_add_rms_norm_linear(platform: Platform, device: Any, dtype_name: str) -> None:
    """``add_rms_norm_linear`` where the backend claims it (``fuses_residual_norm``): the residual sum and the
    product of its RMS norm, plain with a bias and gated, at 1 and 7 rows, against float64."""
    capability = f"gemm.add_rms_norm_linear.{dtype_name}"
    gemm = platform.make_gemm_backend()
    if not gemm.fuses_residual_norm:
        not_claimed("the GEMM backend takes no residual norm into its products (the core runs the norm op)")
    dtype = torch_dtype(dtype_name)
    gen = torch.Generator().manual_seed(73)
    weight = (torch.randn(2 * NORM_D, NORM_K, generator=gen) * NORM_K**-0.5).to(dtype).to(device)
    _check_norm_linear(gemm, gemm.prepare_weight(weight, dtype), weight, dtype, device, get_tolerance(dtype),
                       capability, gen, (1, 7), [None, *sorted(gemm.gated_activations)])  # fmt: skip


@pytest.mark.capability("gemm.add_rms_norm_router.{dtype_name}")
def test_add_rms_norm_router(platform: Platform, device: Any, dtype_name: str) -> None:
    """``add_rms_norm_router`` where the backend claims it (``fuses_router_norm``): a router's logits over the RMS
    norm of the residual sum, the normalised rows and the sum (the experts read both), with a bias and without, at
    1 and 7 rows, against float64."""
    capability = f"gemm.add_rms_norm_router.{dtype_name}"
    gemm = platform.make_gemm_backend()
    if not gemm.fuses_router_norm:
        not_claimed("the GEMM backend takes no residual norm into a router's product (the core runs the norm op)")
    dtype = torch_dtype(dtype_name)
    tol = get_tolerance(dtype)
    gen = torch.Generator().manual_seed(75)
    # 60 experts: the GEMV's last program holds rows past the end
    router = (torch.randn(60, NORM_K, generator=gen) * NORM_K**-0.5).to(dtype).to(device)
    bias = torch.randn(60, generator=gen).to(dtype).to(device)
    prepared = gemm.prepare_weight(router, dtype)
    for rows in (1, 7):
        for b in (bias, None):
            x, residual, norm_weight = _norm_inputs(rows, dtype, device, gen)
            logits, normed, summed = gemm.add_rms_norm_router(x, residual, norm_weight, 1e-5, prepared, b)
            want, want_normed, want_summed = ref_add_rms_norm_router(x, residual, norm_weight, 1e-5, router, b)
            name = f"{capability} M={rows} bias={b is not None}"
            check_output(summed, want_summed, x, tol, f"{name} sum")
            check_output(normed, want_normed, x, tol, f"{name} norm")
            check_output(logits, want, x, tol, name)


@pytest.mark.capability("gemm.quant.{quant_scheme}.residual_norm")
def test_quantized_add_rms_norm_linear(platform: Platform, caps: Capabilities, device: Any, quant_scheme: str) -> None:
    """``add_rms_norm_linear`` over a quantized weight (2 x 100 gate/up rows, K=1024: a GPU's one-row GEMV takes
    the norm into its single step), plain and gated by the first claimed activation, at one row (more rows are
    the norm op and the product: :func:`test_add_rms_norm_linear`'s) in each claimed dtype, against the float64
    product of the dequantized weight."""
    if quant_scheme == "any":
        not_claimed("no quantization schemes are claimed (weights are dequantized at load)")
    capability = f"gemm.quant.{quant_scheme}.residual_norm"
    gemm = platform.make_gemm_backend()
    if not gemm.fuses_residual_norm:
        not_claimed("the GEMM backend takes no residual norm into its products (the core runs the norm op)")
    try:
        weight = make_quantized_weight(quant_scheme, 2 * NORM_D, NORM_K, seed=74, device=device)
    except UnknownSchemeError as exc:
        not_runnable(str(exc))
    dense = ref_dequantize(weight)
    gen = torch.Generator().manual_seed(75)
    for dtype_name in caps.dtypes:
        dtype = torch_dtype(dtype_name)
        _check_norm_linear(gemm, gemm.prepare_weight(weight, dtype), dense, dtype, device,
                           get_tolerance(dtype, quantized=True), f"{capability} {dtype_name}", gen, (1,),
                           [None, *sorted(gemm.gated_activations)[:1]])  # fmt: skip

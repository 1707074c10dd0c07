"""``GemmBackend.normed_linear``: a projection of the residual stream with its add and RMS norm fused in
(plain and post-normed branch, plain and gated product), against the float64 reference, for backends that
set ``fuses_input_norm``; the core adds and normalises the stream itself for every other one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.gemm import InputNorm
from engine.interfaces.platform import Platform
from engine_conformance.helpers import assert_close, torch_dtype
from engine_conformance.pytest_plugin import not_claimed
from engine_plugin_sdk.reference_ops import ref_normed_linear
from engine_plugin_sdk.tolerances import get_tolerance

#: the stream's width (not a multiple of a GEMV's 1024-wide tile) and the outputs (not one of its row tiles)
HIDDEN, OUT = 576, 200
#: one row is the fused batch-1 GEMV on GPUs, more rows the norm kernel then the product
ROWS = (1, 7)


def scales(gen: torch.Generator, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A norm's per-column scale around one, in ``dtype``."""
    return (1.0 + 0.3 * torch.randn(HIDDEN, generator=gen)).to(dtype).to(device)


@pytest.mark.capability("gemm.normed_linear.{dtype_name}")
def test_normed_linear(platform: Platform, device: Any, dtype_name: str) -> None:
    """Product and new residual stream, with and without a post-norm, plain (with a bias) and for each
    gated activation the backend claims."""
    capability = f"gemm.normed_linear.{dtype_name}"
    gemm = platform.make_gemm_backend()
    if not gemm.fuses_input_norm:
        not_claimed("the GEMM backend does not fuse the input norm (the core runs the norm op first)")
    dtype = torch_dtype(dtype_name)
    tol = get_tolerance(dtype)
    gen = torch.Generator().manual_seed(71)
    plain = (torch.randn(OUT, HIDDEN, generator=gen) * HIDDEN**-0.5).to(dtype).to(device)
    gated = (torch.randn(2 * OUT, HIDDEN, generator=gen) * HIDDEN**-0.5).to(dtype).to(device)
    bias = torch.randn(OUT, generator=gen).to(dtype).to(device)
    weights = {None: gemm.prepare_weight(plain, dtype)}
    weights.update({act: gemm.prepare_weight(gated, dtype) for act in sorted(gemm.gated_activations)})
    for rows in ROWS:
        for post in (False, True):
            for activation, prepared in weights.items():
                # a branch output and a stream of different scales, as a layer's are
                x = (3.0 * torch.randn(rows, HIDDEN, generator=gen)).to(dtype).to(device)
                residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype).to(device)
                norm = InputNorm(residual.clone(), scales(gen, dtype, device), 1e-6,
                                 scales(gen, dtype, device) if post else None)  # fmt: skip
                b = bias if activation is None else None
                reference = InputNorm(residual, norm.weight, norm.eps, norm.post_weight)
                expected_y, expected_s = ref_normed_linear(x, reference, plain if activation is None else gated, b, activation)
                y, summed = gemm.normed_linear(x, norm, prepared, b, activation)
                label = f"{capability} M={rows} {'post-norm ' if post else ''}{activation or 'linear'}"
                if y.dtype != dtype or summed.dtype not in (residual.dtype, torch.float32):
                    pytest.fail(f"{label}: dtypes {y.dtype} / {summed.dtype}, expected {dtype}", pytrace=False)
                assert_close(y, expected_y, tol, label)
                assert_close(summed, expected_s, tol, f"{label} residual")
                if not torch.equal(norm.residual, residual):
                    pytest.fail(f"{label}: the residual passed in was modified", pytrace=False)

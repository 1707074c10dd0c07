"""A fused projection whose row blocks were quantized in different schemes, joined by the backend
(``GemmBackend.join_row_blocks``), against the float64 product of the blocks' dequantized stack."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import assert_close, torch_dtype
from engine_conformance.pytest_plugin import not_claimed, not_runnable
from engine_plugin_sdk.quant import UnknownSchemeError, make_quantized_weight
from engine_plugin_sdk.reference_ops import ref_dequantize, ref_linear
from engine_plugin_sdk.tolerances import get_tolerance

#: GGUF Q4_K_M's q / k in Q4_K over v in Q6_K where both are claimed, else the first two claimed schemes
PREFERRED = ("gguf_q4_k", "gguf_q6_k")
#: q / k rows over v rows, a 256-column reduction (a K-quant super-block)
ROWS, K = (64, 32), 256


def _schemes(caps: Capabilities) -> tuple[str, str]:
    claimed = sorted(caps.quant_schemes)
    if all(s in claimed for s in PREFERRED):
        return PREFERRED
    if len(claimed) < 2:
        not_claimed("fewer than two quantization schemes are claimed: no projection mixes them")
    return claimed[0], claimed[1]


@pytest.mark.capability("gemm.row_blocks.{dtype_name}")
def test_joined_row_blocks(platform: Platform, caps: Capabilities, device: Any, dtype_name: str) -> None:
    """Where ``join_row_blocks`` joins two blocks of two claimed schemes: one row (a decode step) and three, with
    a bias, against float64; not claimed where the backend keeps the blocks apart (the core runs a product a
    block)."""
    capability = f"gemm.row_blocks.{dtype_name}"
    gemm = platform.make_gemm_backend()
    try:
        parts = [make_quantized_weight(s, n, K, seed=81 + i, device=device)
                 for i, (s, n) in enumerate(zip(_schemes(caps), ROWS, strict=True))]  # fmt: skip
    except UnknownSchemeError as exc:
        not_runnable(str(exc))
    dtype = torch_dtype(dtype_name)
    joined = gemm.join_row_blocks([gemm.prepare_weight(p, dtype) for p in parts], ROWS)
    if joined is None:
        not_claimed("the GEMM backend keeps row blocks apart (the core runs a product a block)")
    stacked = torch.cat([ref_dequantize(p) for p in parts])
    gen = torch.Generator().manual_seed(82)
    bias = torch.randn(sum(ROWS), generator=gen).to(dtype).to(device)
    tol = get_tolerance(dtype, quantized=True)
    for rows in (1, 3):
        x = torch.randn(rows, K, generator=gen).to(dtype).to(device)
        out = gemm.linear(x, joined, bias)
        if out.dtype != dtype or tuple(out.shape) != (rows, sum(ROWS)):
            pytest.fail(f"{capability}: output {out.dtype} {tuple(out.shape)}, expected {dtype} "
                        f"{(rows, sum(ROWS))}", pytrace=False)  # fmt: skip
        assert_close(out, ref_linear(x, stacked, bias), tol, f"{capability} M={rows}")

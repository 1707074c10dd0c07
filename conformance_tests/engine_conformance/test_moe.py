"""Mixture of experts (``GemmBackend.prepare_experts`` / ``fused_moe``) against the float64 reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.platform import Platform
from engine_conformance.helpers import assert_close, torch_dtype
from engine_plugin_sdk.reference_ops import ref_fused_moe
from engine_plugin_sdk.tolerances import get_tolerance

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, TOKENS = 128, 96, 6, 2, 13


def moe_case(dtype: torch.dtype, device: Any) -> tuple[torch.Tensor, list, list, torch.Tensor, torch.Tensor]:
    """Fresh random experts and routing: the last expert gets no token, token 0 names expert 1 twice,
    and one token's weights do not sum to one (routings without renormalisation)."""
    gen = torch.Generator().manual_seed(4242)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype).to(device)
    gate_up = [(torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen) * HIDDEN**-0.5).to(dtype).to(device) for _ in range(EXPERTS)]
    down = [(torch.randn(HIDDEN, INTERMEDIATE, generator=gen) * INTERMEDIATE**-0.5).to(dtype).to(device) for _ in range(EXPERTS)]
    ids = torch.randint(0, EXPERTS - 1, (TOKENS, TOP_K), generator=gen)
    ids[0] = 1
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    weights[1:] = weights[1:] / weights[1:].sum(dim=-1, keepdim=True)
    return x, gate_up, down, weights.to(device), ids.to(device)


@pytest.mark.capability("moe.fused.{dtype_name}")
def test_fused_moe(platform: Platform, device: Any, dtype_name: str) -> None:
    capability = f"moe.fused.{dtype_name}"
    dtype = torch_dtype(dtype_name)
    gemm = platform.make_gemm_backend()
    x, gate_up, down, weights, ids = moe_case(dtype, device)
    experts = gemm.prepare_experts(gate_up, down, dtype)
    out = gemm.fused_moe(x, experts, weights, ids)
    if out.dtype != dtype or tuple(out.shape) != (TOKENS, HIDDEN):
        pytest.fail(f"{capability}: output {out.dtype} {tuple(out.shape)}, expected {dtype} {(TOKENS, HIDDEN)}", pytrace=False)
    assert_close(out, ref_fused_moe(x, gate_up, down, weights, ids), get_tolerance(dtype), capability)
    # no token at all: an empty output, not an error
    empty = gemm.fused_moe(x[:0], experts, weights[:0], ids[:0])
    if tuple(empty.shape) != (0, HIDDEN):
        pytest.fail(f"{capability}: no tokens gave shape {tuple(empty.shape)}", pytrace=False)

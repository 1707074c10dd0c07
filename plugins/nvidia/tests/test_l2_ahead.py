"""The GEMVs' L2 requests before their PDL wait (``l2_ahead``, the MoE down GEMV's ``down_l2_rest``): the path only
CUDA graphs with PDL compile, run in the interpreter with the waits stubbed and no PTX (the requests are PTX): the
same products as without it, bit for bit, so the address arithmetic around them leaves the sums alone. The GPU runs
it with the requests in ``test_pdl.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels import gemv_kernels, gemv_launchers, moe_kernels, pdl
from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import INTERPRETER_MOE_TILES, fused_moe


@triton.jit
def _no_wait():
    # the interpreter runs a jit function only where its module holds triton.language
    tl.static_assert(True)


@pytest.fixture
def stubbed_pdl(monkeypatch: pytest.MonkeyPatch):
    """PDL launches' kernel flag on, the waits stubbed, no ``launch_pdl`` option (the interpreter has none)."""
    for module in (gemv_kernels, moe_kernels, pdl):
        monkeypatch.setattr(module, "gdc_wait", _no_wait)
        monkeypatch.setattr(module, "gdc_launch_dependents", _no_wait)
    options = pdl.launch_options
    monkeypatch.setattr(pdl, "launch_options", lambda: {k: v for k, v in options().items() if k != "launch_pdl"})
    return lambda active: monkeypatch.setattr(pdl, "_active", active)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real PDL path (test_pdl.py)")
@pytest.mark.parametrize("l2_ahead", [1, 3])
def test_gemvs_with_l2_requests_match_the_plain_path(stubbed_pdl, l2_ahead: int) -> None:
    gen = torch.Generator().manual_seed(31 + l2_ahead)
    # 3 tiles of 64 columns, the last one ragged; 37 rows: a last program past the rows, later programs past the end
    k, n = 150, 37
    x = torch.randn(1, k, generator=gen).half()
    w = (torch.randn(2 * n, k, generator=gen) * k**-0.5).half()
    results = []
    for active, ahead in ((False, 0), (True, 0), (True, l2_ahead)):
        stubbed_pdl(active)
        plain = gemv_launchers.gemv(x, w, block_n=4, block_k=64, prefetch=2, l2_ahead=ahead)
        gated = gemv_launchers.gated_gemv(x, w, "silu", block_n=2, block_k=64, prefetch=2, l2_ahead=ahead)
        results.append((plain, gated))
    for got in results[1:]:
        assert torch.equal(got[0], results[0][0]) and torch.equal(got[1], results[0][1])
    want = x.double() @ w.double().T
    torch.testing.assert_close(results[0][0].double(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real PDL path (test_pdl.py)")
def test_moe_down_gemv_with_l2_requests_matches_the_plain_path(stubbed_pdl) -> None:
    gen = torch.Generator().manual_seed(41)
    experts, hidden, inter, top_k = 6, 32, 80, 5
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).half()
    down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).half()
    x = torch.randn(1, hidden, generator=gen).half()
    weights = torch.rand(1, top_k, generator=gen)
    ids = torch.randperm(experts, generator=gen)[:top_k].view(1, top_k)
    # 32-column tiles: 3 a row of ``down``, the first 2 experts' first tile loaded before the wait
    tiles = dataclasses.replace(INTERPRETER_MOE_TILES, down_gemv=(8, 32, 4), down_prefetch=2)
    results = []
    for active, rest in ((False, False), (True, False), (True, True)):
        stubbed_pdl(active)
        results.append(fused_moe(x, gate_up, down, weights, ids, dataclasses.replace(tiles, down_l2_rest=rest)))
    assert torch.equal(results[1], results[0]) and torch.equal(results[2], results[0])

"""Programmatic dependent launch (GPU with compute capability 9.0+ only): chains of dependent kernels,
eager and replayed from a CUDA graph, give the float64 reference's answer with PDL on. The switch itself
(graph captures only) is checked everywhere."""

from __future__ import annotations

import pytest
import torch

from engine_plugin_sdk.gpu.triton_kernels import gemv_launchers, launchers, pdl
from engine_plugin_sdk.reference_ops import ref_fused_add_rms_norm, ref_silu_and_mul

needs_pdl = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and pdl.AVAILABLE),
    reason="PDL needs an NVIDIA GPU of compute capability 9.0+",
)


@pytest.fixture
def pdl_on():
    """PDL launches for the test's eager runs and its capture (normally only graph captures use it)."""
    before = pdl.enabled()
    assert pdl.configure(True)
    with pdl.for_capture():
        assert pdl.launch_options()["USE_PDL"]
        yield
    pdl.configure(before)


def _chain(x, residual, norm_w, w_up, w_down, prefetch=1):
    """norm -> wide GEMV -> silu_and_mul -> narrow GEMV -> norm: each kernel reads the one before it (the
    GEMVs loading ``prefetch`` weight tiles before their wait)."""
    h, res = launchers.fused_add_rms_norm(x, residual, norm_w, 1e-6)
    up = gemv_launchers.gemv(h, w_up, block_n=8, block_k=512, prefetch=prefetch)
    act = launchers.silu_and_mul(up)
    down = gemv_launchers.gemv(act, w_down, block_n=4, block_k=1024, prefetch=prefetch)
    return launchers.fused_add_rms_norm(down, res, norm_w, 1e-6)


def _reference(x, residual, norm_w, w_up, w_down):
    h, res = ref_fused_add_rms_norm(x.double(), residual.double(), norm_w.double(), 1e-6)
    act = ref_silu_and_mul(h @ w_up.double().T)
    return ref_fused_add_rms_norm(act @ w_down.double().T, res, norm_w.double(), 1e-6)


@needs_pdl
@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_dependent_chain_eager_and_in_a_graph(pdl_on, prefetch):
    gen = torch.Generator(device="cuda").manual_seed(11)
    hidden, inter = 1024, 3072

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    w_up, w_down = rand(2 * inter, hidden, scale=hidden**-0.5), rand(hidden, inter, scale=inter**-0.5)
    norm_w = rand(hidden)
    x, residual = rand(1, hidden), rand(1, hidden)
    static = (x.clone(), residual.clone())
    for _ in range(2):  # compile outside the capture
        _chain(*static, norm_w, w_up, w_down, prefetch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _chain(*static, norm_w, w_up, w_down, prefetch)
    for trial in range(3):
        x, residual = rand(1, hidden), rand(1, hidden)
        ref_out, ref_res = _reference(x, residual, norm_w, w_up, w_down)
        eager_out, eager_res = _chain(x, residual, norm_w, w_up, w_down, prefetch)
        static[0].copy_(x)
        static[1].copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        for got, ref, what in ((eager_out, ref_out, "eager"), (captured[0], ref_out, "graph")):
            err = ((got.double() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"{what} trial {trial}: relative error {err:.3g}"
        torch.testing.assert_close(eager_res.double(), ref_res, rtol=1e-2, atol=1e-2)
        assert torch.equal(captured[0], eager_out), "graph replay and eager launch must agree bit for bit"


def test_pdl_is_for_graph_captures_only():
    before = pdl.enabled()
    try:
        pdl.configure(True)
        assert not pdl.launch_options()["USE_PDL"], "eager launches never use PDL"
        with pdl.for_capture():
            assert pdl.launch_options()["USE_PDL"] == pdl.AVAILABLE
        assert not pdl.launch_options()["USE_PDL"]
        pdl.configure(False)
        with pdl.for_capture():
            assert pdl.launch_options() == {"USE_PDL": False}
    finally:
        pdl.configure(before)


@needs_pdl
@pytest.mark.parametrize(("down_gemv", "prefetch"), [((4, 1024, 4), 4), ((4, 256, 4), 4), ((4, 256, 4), 2)])
def test_batch_one_moe_down_reads_its_early_experts_tiles_before_the_wait(pdl_on, down_gemv, prefetch):
    """The down GEMV's first tiles of ``prefetch`` experts, loaded before its PDL wait, are the routed ones:
    a batch-1 MoE (top 8 of 16 experts, 768 columns as Qwen3-30B-A3B's) against float64, eager and replayed."""
    from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import MoeTiles, fused_moe
    from engine_plugin_sdk.reference_ops import ref_fused_moe

    gen = torch.Generator(device="cuda").manual_seed(12)
    experts, hidden, inter, top_k = 16, 1024, 768, 8
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, generator=gen, device="cuda") * inter**-0.5).bfloat16()
    tiles = MoeTiles(down_gemv=down_gemv, down_prefetch=prefetch)
    static_x = torch.randn(1, hidden, generator=gen, device="cuda").bfloat16()
    static_w = torch.rand(1, top_k, generator=gen, device="cuda")
    static_ids = torch.randperm(experts, generator=gen, device="cuda")[:top_k].view(1, top_k)
    fused_moe(static_x, gate_up, down, static_w, static_ids, tiles)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(static_x, gate_up, down, static_w, static_ids, tiles)
    for trial in range(3):
        x = torch.randn(1, hidden, generator=gen, device="cuda").bfloat16()
        weights = torch.rand(1, top_k, generator=gen, device="cuda")
        ids = torch.randperm(experts, generator=gen, device="cuda")[:top_k].view(1, top_k)
        want = ref_fused_moe(x.cpu(), list(gate_up.cpu()), list(down.cpu()), weights.cpu(), ids.cpu())
        eager = fused_moe(x, gate_up, down, weights, ids, tiles)
        static_x.copy_(x)
        static_w.copy_(weights)
        static_ids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        for got, what in ((eager, "eager"), (captured, "graph")):
            err = ((got.double().cpu() - want).norm() / want.norm()).item()
            assert err < 2e-2, f"{what} trial {trial}: relative error {err:.3g}"


@needs_pdl
@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_router_takes_the_norm_after_the_products_wait(pdl_on, prefetch):
    """The router's GEMV with the residual norm in its programs (``add_rms_norm_gemv``, Qwen3-30B-A3B's 128 x 2,048
    router) after the GEMV that writes its input, eager and replayed: the logits, the normalised row and the sum
    against float64, the sum and row bit for bit the norm kernel's."""
    from engine_plugin_sdk.reference_ops import ref_add_rms_norm_router

    gen = torch.Generator(device="cuda").manual_seed(13)
    hidden, experts = 2048, 128
    w_o = (torch.randn(hidden, 4096, generator=gen, device="cuda") * 4096**-0.5).bfloat16()
    router = (torch.randn(experts, hidden, generator=gen, device="cuda") * hidden**-0.5).bfloat16()
    norm_w = (torch.rand(hidden, generator=gen, device="cuda") + 0.5).bfloat16()

    def chain(attn, residual):
        out = gemv_launchers.gemv(attn, w_o, block_n=4, block_k=1024, prefetch=2)
        return gemv_launchers.add_rms_norm_gemv(out, residual, norm_w, 1e-6, router, prefetch=prefetch), out

    static = (torch.randn(1, 4096, generator=gen, device="cuda").bfloat16(),
              torch.randn(1, hidden, generator=gen, device="cuda").bfloat16())  # fmt: skip
    chain(*static)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = chain(*static)
    for trial in range(3):
        attn, residual = torch.randn(1, 4096, generator=gen, device="cuda").bfloat16(), static[1].clone()
        (eager, out) = chain(attn, residual)
        want = ref_add_rms_norm_router(out, residual, norm_w, 1e-6, router)
        unfused = launchers.fused_add_rms_norm(out, residual, norm_w, 1e-6)
        static[0].copy_(attn)
        graph.replay()
        torch.cuda.synchronize()
        for got, what in ((eager, "eager"), (captured, "graph")):
            for part, ref, name in zip(got, want, ("logits", "norm", "sum"), strict=True):
                err = ((part.double() - ref).norm() / ref.norm()).item()
                assert err < 2e-2, f"{what} {name} trial {trial}: relative error {err:.3g}"
            assert torch.equal(got[2], unfused[1]), f"{what} trial {trial}: the sum is the norm kernel's"
        assert all(torch.equal(a, b) for a, b in zip(captured, eager, strict=True)), "graph and eager agree"

"""The single-row GEMVs that build the normalised residual stream themselves (``normed_gemv``) against the
float64 reference, on small shapes (interpreter on the CPU): ragged row blocks, K tails, several programs
(only the first stores the new stream), post-normed branches, biases and both gated activations."""

from __future__ import annotations

import pytest
import torch

from engine_plugin_sdk import InputNorm
from engine_plugin_sdk.gpu.triton_kernels import gemv_launchers
from engine_plugin_sdk.reference_ops import ref_normed_linear

CASES = [(40, 64, (16, 32), torch.float16), (37, 100, (8, 32), torch.float32), (24, 2048, (4, 1024), torch.float16)]


def stream(gen: torch.Generator, k: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A branch output, a residual stream and two norm scales of width ``k``."""
    x = (3.0 * torch.randn(1, k, generator=gen)).to(dtype).to(device)
    residual = torch.randn(1, k, generator=gen).to(dtype).to(device)
    weight, post = (1.0 + 0.3 * torch.randn(2, k, generator=gen)).to(dtype).to(device)
    return x, residual, weight, post


@pytest.mark.parametrize("post_norm", [False, True])
@pytest.mark.parametrize("activation", [None, "silu", "gelu_tanh"])
@pytest.mark.parametrize(("out_features", "in_features", "tile", "dtype"), CASES)
def test_normed_gemv_matches_float64(device, post_norm, activation, out_features, in_features, tile, dtype):
    gen = torch.Generator().manual_seed(out_features * in_features + 7 * post_norm)
    x, residual, norm_weight, post = stream(gen, in_features, dtype, device)
    rows = out_features if activation is None else 2 * out_features
    weight = (torch.randn(rows, in_features, generator=gen) * in_features**-0.5).to(dtype).to(device)
    bias = torch.randn(rows, generator=gen).to(dtype).to(device) if activation is None else None
    post_weight = post if post_norm else None
    before = residual.clone()
    y, summed = gemv_launchers.normed_gemv(
        x, residual, norm_weight, 1e-6, weight, bias, post_weight, activation, block_n=tile[0], block_k=tile[1]
    )
    ref_y, ref_s = ref_normed_linear(x, InputNorm(before, norm_weight, 1e-6, post_weight), weight, bias, activation)
    assert y.shape == ref_y.shape and y.dtype == dtype and summed.shape == x.shape and summed.dtype == dtype
    # the stream is stored rounded to its dtype (as the unfused sum is); the product accumulates in float32
    tol = 4e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(summed.double(), ref_s, rtol=tol, atol=tol * ref_s.abs().max().item())
    torch.testing.assert_close(y.double(), ref_y, rtol=tol, atol=tol * ref_y.abs().max().item())
    assert torch.equal(residual, before), "the residual read must not be written"


def test_normed_gemv_refusals(device):
    x = torch.randn(1, 64).to(device)
    weight = torch.randn(30, 64).to(device)
    ones = torch.ones(64).to(device)
    with pytest.raises(ValueError, match="one row"):
        gemv_launchers.normed_gemv(torch.randn(2, 64).to(device), torch.randn(2, 64).to(device), ones, 1e-6, weight)
    with pytest.raises(ValueError, match="does not fit"):
        gemv_launchers.normed_gemv(x, x.clone(), ones[:32], 1e-6, weight)
    with pytest.raises(ValueError, match="unknown gated activation"):
        gemv_launchers.normed_gemv(x, x.clone(), ones, 1e-6, weight, activation="relu")
    with pytest.raises(ValueError, match="no bias"):
        gemv_launchers.normed_gemv(x, x.clone(), ones, 1e-6, weight, torch.zeros(30).to(device), activation="silu")


def test_backend_takes_the_normed_gemv_for_one_row_on_a_gpu(device, monkeypatch):
    """One bf16/fp16 row on a GPU runs the fused GEMV; the CPU (interpreter) and more rows take the norm
    kernel then the product. Both match float64."""
    from engine_plugin_nvidia import gemm

    calls: list[int] = []
    original = gemv_launchers.normed_gemv

    def counting(x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(x.shape[0])
        return original(x, *args, **kwargs)

    monkeypatch.setattr(gemv_launchers, "normed_gemv", counting)
    backend = gemm.CudaGemmBackend(device)
    backend.triton_input_norm = True
    gen = torch.Generator().manual_seed(405)
    weight = (torch.randn(40, 96, generator=gen) * 96**-0.5).to(torch.float16).to(device)
    for rows in (1, 3):
        x, residual, norm_weight, _ = stream(gen, 96, torch.float16, device)
        x, residual = x.expand(rows, 96).contiguous(), residual.expand(rows, 96).contiguous()
        norm = InputNorm(residual, norm_weight, 1e-6)
        y, summed = backend.normed_linear(x, norm, weight)
        ref_y, ref_s = ref_normed_linear(x, norm, weight)
        torch.testing.assert_close(y.double(), ref_y, rtol=4e-3, atol=4e-3 * ref_y.abs().max().item())
        torch.testing.assert_close(summed.double(), ref_s, rtol=4e-3, atol=4e-3)
    assert calls == ([1] if device.type == "cuda" else [])

"""The attention's q/k/v taking the residual norm before it into its batch-1 GEMV (``ENGINE_NVIDIA_LINEAR_NORM``):
the setting, the product against float64, and a tiny Llama decoding alike with it."""

from __future__ import annotations

import pytest
import torch

from engine_plugin_nvidia.gemm import (
    GEMV_TILE,
    LINEAR_NORM_ENV,
    LINEAR_NORM_MAX_BYTES,
    CudaGemmBackend,
    linear_norm_tile,
)
from engine_plugin_sdk.gpu.triton_kernels import gemv_launchers
from engine_plugin_sdk.reference_ops import ref_add_rms_norm_linear


def test_the_setting_is_off_one_or_a_tile() -> None:
    assert linear_norm_tile("0") is None and linear_norm_tile("") is None
    assert linear_norm_tile("1") == GEMV_TILE
    assert linear_norm_tile(" 16,256,4 ") == {"block_n": 16, "block_k": 256, "num_warps": 4, "num_stages": 2,
                                              "prefetch": 2}  # fmt: skip
    with pytest.raises(ValueError, match=LINEAR_NORM_ENV):
        linear_norm_tile("16x256")


def test_unset_gpus_take_it_for_small_weights_and_a_setting_for_every_size(monkeypatch) -> None:
    """Unset: on GPUs only (not the interpreter's CPU device), and there for q/k/v weights of at most
    LINEAR_NORM_MAX_BYTES (Qwen3-30B-A3B's, not Llama-3-8B's); ``1`` or a tile: every size; ``0``: none."""
    qwen3_moe = torch.empty(5120, 2048, dtype=torch.bfloat16, device="meta")
    llama3_8b = torch.empty(6144, 4096, dtype=torch.bfloat16, device="meta")
    assert qwen3_moe.numel() * 2 <= LINEAR_NORM_MAX_BYTES < llama3_8b.numel() * 2
    monkeypatch.delenv(LINEAR_NORM_ENV, raising=False)
    assert not CudaGemmBackend(torch.device("cpu")).triton_linear_norm
    unset = CudaGemmBackend(torch.device("cpu"))
    unset.triton_linear_norm = True  # what a GPU device sets
    assert unset._linear_norm_tile(qwen3_moe) == GEMV_TILE and unset._linear_norm_tile(llama3_8b) is None
    monkeypatch.setenv(LINEAR_NORM_ENV, "1")
    every = CudaGemmBackend(torch.device("cpu"))
    assert every.triton_linear_norm and every._linear_norm_tile(llama3_8b) == GEMV_TILE
    monkeypatch.setenv(LINEAR_NORM_ENV, "0")
    assert not CudaGemmBackend(torch.device("cpu")).triton_linear_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_row_runs_the_gemv_with_the_norm_and_more_rows_the_norm_kernel(device, dtype, monkeypatch) -> None:
    """One row (90 outputs: the last program holds rows past the end; a bias) goes through the GEMV that sums and
    normalises the row in its programs, seven rows through the norm kernel and the product; both against float64."""
    monkeypatch.setenv(LINEAR_NORM_ENV, "4,64,4")
    gemm = CudaGemmBackend(device)
    assert gemm.triton_linear_norm and gemm.fuses_residual_norm
    launched: list[int] = []
    real = gemv_launchers.add_rms_norm_gemv
    monkeypatch.setattr(gemv_launchers, "add_rms_norm_gemv", lambda *a, **k: launched.append(k["block_k"]) or real(*a, **k))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    k = 256
    weight = (torch.randn(90, k, generator=gen) * k**-0.5).to(dtype).to(device)
    bias = torch.randn(90, generator=gen).to(dtype).to(device)
    norm_weight = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(device)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 7):
        x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
        residual = (torch.randn(rows, k, generator=gen) * 4).to(dtype).to(device)
        out, summed = gemm.add_rms_norm_linear(x, residual, norm_weight, 1e-5, weight, bias)
        want, want_summed = ref_add_rms_norm_linear(
            *(t.double() for t in (x, residual, norm_weight)), 1e-5, weight.double(), bias.double()
        )
        assert out.dtype == dtype and summed.dtype == dtype
        torch.testing.assert_close(summed.double(), want_summed, rtol=tol, atol=tol)
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    assert launched == [64], "one row in the GEMV with the norm, at the setting's tile; seven rows not"


@pytest.mark.slow  # two engines in the interpreter
def test_a_llama_decodes_alike_with_the_norm_in_its_qkv_gemv(tmp_path, monkeypatch) -> None:
    """A tiny Llama on device ``cuda`` in the interpreter, float32: with the setting each single-token step's
    attention norms but the first layer's (no residual to add there) run in the q/k/v GEMV's programs, and the
    greedy tokens and log-probabilities are those with the norm as its own launch."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: device cuda is not the interpreter here")
    from engine import LLM, SamplingParams
    from engine_plugin_nvidia.platform import INTERPRET_ENV
    from engine_plugin_sdk.testing import build_tiny_llama

    monkeypatch.setenv(INTERPRET_ENV, "1")
    layers = 2
    build_tiny_llama(tmp_path, head_dim=64, seed=int(torch.randint(0, 1 << 20, ())), num_layers=layers)
    launched: list[int] = []
    real = gemv_launchers.add_rms_norm_gemv
    monkeypatch.setattr(gemv_launchers, "add_rms_norm_gemv", lambda *a, **k: launched.append(1) or real(*a, **k))

    def decode(setting: str) -> tuple[list[int], list[float]]:
        monkeypatch.setenv(LINEAR_NORM_ENV, setting)
        llm = LLM(model=str(tmp_path), device="cuda", dtype="float32", block_size=16, max_num_seqs=1,
                  max_model_len=64, kv_cache_memory_bytes=8 << 20, enforce_eager=True)  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
        out = llm.generate([[1, 5, 9, 33, 7, 12]], params, use_tqdm=False)[0].outputs[0]
        llm.shutdown()
        return list(out.token_ids), [step[t].logprob for step, t in zip(out.logprobs, out.token_ids, strict=True)]

    tokens, logprobs = decode("4,64,4")
    assert len(launched) == 2 * (layers - 1), launched  # two single-token steps
    launched.clear()
    want_tokens, want_logprobs = decode("0")
    assert not launched
    assert tokens == want_tokens
    assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_the_norm_gemv_asking_l2_for_a_later_weight_changes_nothing(device) -> None:
    """``l2_ahead`` (an experiment: the router's programs ask L2 for a later product's weight past their wait): the
    product, the normalised row and the sum bit for bit as without, over a weight whose lines do not split evenly."""
    gen = torch.Generator().manual_seed(17)
    k = 256
    weight = (torch.randn(90, k, generator=gen) * k**-0.5).to(torch.float16).to(device)
    norm_weight = (torch.rand(k, generator=gen) + 0.5).to(torch.float16).to(device)
    x, residual = (torch.randn(1, k, generator=gen).to(torch.float16).to(device) for _ in range(2))
    later = torch.randn(33, 70, generator=gen).to(torch.float16).to(device)
    tile = {"block_n": 4, "block_k": 64, "num_warps": 4}
    plain = gemv_launchers.add_rms_norm_gemv(x, residual, norm_weight, 1e-5, weight, **tile)
    asking = gemv_launchers.add_rms_norm_gemv(x, residual, norm_weight, 1e-5, weight, **tile, l2_ahead=later)
    for got, want in zip(asking, plain, strict=True):
        assert torch.equal(got, want)

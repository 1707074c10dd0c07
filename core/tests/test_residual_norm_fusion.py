"""The residual add and RMS norm handed to the product after them (``GemmBackend.fuses_residual_norm`` /
``add_rms_norm_linear``, and a mixture of experts' router: ``fuses_router_norm`` / ``add_rms_norm_router``): which
products the layers hand them to (q/k/v and gate/up of a dense layer, the attention's and the router's in a mixture
of experts, none in parallel-branch layers) and that the model's tokens and log-probabilities are the unfused ones,
through ``LLM.generate``, with a backend that fuses by running the model's own norm op and product."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dense_model_utils import save_tiny_with_a_llama_tokenizer

from engine import LLM, SamplingParams


class FusingGemm:
    """The model's GEMM backend, claiming the fusion and running it as the op table's norm then the product;
    records each call's ``(weight rows, activation)``."""

    def __init__(self, inner: Any, ops: Any, router: bool = False) -> None:
        self.inner, self.ops = inner, ops
        self.calls: list[tuple[int, str | None]] = []
        self.fuses_residual_norm = not router
        self.fuses_router_norm = router

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def add_rms_norm_linear(
        self, x: Any, residual: Any, norm_weight: Any, eps: float, weight: Any, bias: Any = None,
        activation: str | None = None,
    ) -> tuple[Any, Any]:  # fmt: skip
        self.calls.append((x.shape[0], activation))
        normed, summed = self.ops.fused_add_rms_norm(x, residual, norm_weight, eps)
        if activation is None:
            return self.inner.linear(normed, weight, bias), summed
        return self.inner.gated_linear(normed, weight, activation), summed


    def add_rms_norm_router(
        self, x: Any, residual: Any, norm_weight: Any, eps: float, router: Any, bias: Any = None
    ) -> tuple[Any, Any, Any]:  # fmt: skip
        self.calls.append((x.shape[0], "router"))
        normed, summed = self.ops.fused_add_rms_norm(x, residual, norm_weight, eps)
        return self.inner.linear(normed, router, bias), normed, summed


def _decode(path: str, fuse: bool, router: bool = False) -> tuple[list[int], list[float], list[tuple[int, str | None]]]:
    llm = LLM(model=path, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=2)
    model = llm.llm_engine.model
    calls: list[tuple[int, str | None]] = []
    if fuse:
        model.gemm = FusingGemm(model.gemm, model.ops, router)
        calls = model.gemm.calls
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    out = llm.generate([[3, 17, 90, 41, 8, 200]], params, use_tqdm=False)[0].outputs[0]
    llm.shutdown()
    logprobs = [step[t].logprob for step, t in zip(out.logprobs, out.token_ids, strict=True)]
    return list(out.token_ids), logprobs, calls


@pytest.mark.parametrize(
    ("architecture", "per_step", "overrides"),
    [
        # each layer's MLP norm, and the attention norm of every layer after the first (which has no residual)
        ("LlamaForCausalLM", lambda layers: 2 * layers - 1, {}),
        # the experts read the norm's output through their router: only the attention norms go
        ("Qwen3MoeForCausalLM", lambda layers: layers - 1, {}),
    ],
)
def test_fused_norms_give_the_unfused_tokens(tmp_path: Path, architecture: str, per_step: Any, overrides: dict) -> None:
    path = save_tiny_with_a_llama_tokenizer(architecture, str(tmp_path), **overrides)
    tokens, logprobs, _ = _decode(path, fuse=False)
    fused_tokens, fused_logprobs, calls = _decode(path, fuse=True)
    assert fused_tokens == tokens
    assert fused_logprobs == logprobs  # the same ops in the same order: bit for bit
    layers = LLM_LAYERS
    # the prompt's step, then four single-token steps
    assert len(calls) == 5 * per_step(layers), calls
    assert {rows for rows, _ in calls} == {6, 1}
    gated = [act for _, act in calls if act is not None]
    assert all(act == "silu" for act in gated)
    assert len(gated) == (5 * layers if architecture.startswith("Llama") else 0)


#: the tiny checkpoints' layer count (dense_model_utils.TINY)
LLM_LAYERS = 2


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("Qwen3MoeForCausalLM", {}),
        ("Qwen2MoeForCausalLM", {}),  # a gated shared expert reads the normalised rows too
        ("GptOssForCausalLM", {"num_local_experts": 4, "intermediate_size": 64, "pad_token_id": 0}),  # a router bias
    ],
)
def test_a_router_takes_its_norm_and_gives_the_unfused_tokens(tmp_path: Path, architecture: str, overrides: dict) -> None:
    """Each mixture-of-experts layer hands its MLP norm to the router, whose experts (and a shared expert) read the
    normalised rows it returns: the same tokens and log-probabilities, bit for bit."""
    path = save_tiny_with_a_llama_tokenizer(architecture, str(tmp_path), **overrides)
    tokens, logprobs, _ = _decode(path, fuse=False)
    fused_tokens, fused_logprobs, calls = _decode(path, fuse=True, router=True)
    assert (fused_tokens, fused_logprobs) == (tokens, logprobs)
    # the prompt's step, then four single-token steps, a router a layer
    assert calls == [(6, "router")] * LLM_LAYERS + [(1, "router")] * (4 * LLM_LAYERS)


def test_parallel_branches_keep_their_norm(tmp_path: Path) -> None:
    """Cohere's attention and MLP read one norm's output: nothing is handed to a product."""
    path = save_tiny_with_a_llama_tokenizer("CohereForCausalLM", str(tmp_path))
    tokens, logprobs, _ = _decode(path, fuse=False)
    fused_tokens, fused_logprobs, calls = _decode(path, fuse=True)
    assert (fused_tokens, fused_logprobs, calls) == (tokens, logprobs, [])


def test_a_backend_that_does_not_fuse_refuses(tmp_path: Path) -> None:
    from engine_plugin_sdk.reference_backends import ReferenceGemmBackend

    gemm = ReferenceGemmBackend()
    assert not gemm.fuses_residual_norm
    x = torch.randn(1, 8)
    with pytest.raises(ValueError, match="does not fuse the residual norm"):
        gemm.add_rms_norm_linear(x, x, torch.ones(8), 1e-6, torch.randn(4, 8))
    assert not gemm.fuses_router_norm
    with pytest.raises(ValueError, match="does not fuse the residual norm into the router"):
        gemm.add_rms_norm_router(x, x, torch.ones(8), 1e-6, torch.randn(4, 8))

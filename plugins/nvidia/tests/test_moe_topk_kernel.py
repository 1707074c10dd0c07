"""The GPU routing kernel (``moe_topk``: a pick one maximum over keys packing each choice with its index; softmax
routing without a bias picks by the logits and weighs by the picked ones) against the float64 reference: the experts' counts of the served MoE families, renormalised or not, grouped
sigmoid routing with a correction bias, ties (first index wins), and NaN logits (every slot still one expert in
range, none twice). Interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import moe_topk
from engine_plugin_sdk.reference_ops import ref_moe_topk


def distinct_logits(gen: torch.Generator, tokens: int, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Logits whose values differ in ``dtype`` within each row (so that the order of the top ones is unambiguous)."""
    steps = torch.linspace(-4.0, 4.0, experts)
    return torch.stack([steps[torch.randperm(experts, generator=gen)] for _ in range(tokens)]).to(dtype)


@pytest.mark.parametrize(
    ("experts", "top_k", "renormalize"),
    [(8, 2, True), (32, 4, True), (64, 8, False), (128, 8, True), (60, 4, False)],
    ids=["mixtral", "gpt-oss", "olmoe", "qwen3-moe", "qwen2-moe"],
)
def test_routing_matches_float64(device, experts: int, top_k: int, renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(experts + top_k)
    for dtype in (torch.bfloat16, torch.float32):
        logits = distinct_logits(gen, 5, experts, dtype)
        weights, ids = moe_topk(logits.to(device), top_k, renormalize)
        want_w, want_ids = ref_moe_topk(logits, top_k, renormalize)
        assert torch.equal(ids.cpu(), want_ids), (dtype, ids, want_ids)
        torch.testing.assert_close(weights.cpu().double(), want_w, rtol=2e-6, atol=1e-7)


def test_grouped_sigmoid_routing_with_a_bias(device) -> None:
    """DeepSeek-V3's form: 256 experts in 8 groups, the best 4 groups by their two best, a correction bias to
    choose with, the unbiased scores renormalised and scaled."""
    gen = torch.Generator().manual_seed(3)
    logits = distinct_logits(gen, 3, 256, torch.float32)
    bias = torch.randn(256, generator=gen) * 0.01
    for group_score in ("top2", "max"):
        args = (8, True, "sigmoid", bias, 8, 4, 2.5, group_score)
        weights, ids = moe_topk(logits.to(device), args[0], *args[1:3], bias.to(device), *args[4:])
        want_w, want_ids = ref_moe_topk(logits, *args)
        assert torch.equal(ids.cpu(), want_ids), group_score
        torch.testing.assert_close(weights.cpu().double(), want_w, rtol=2e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert(device) -> None:
    """Equal logits everywhere: the first experts in order, equal weights; one other row with a tie inside its top."""
    logits = torch.zeros(2, 16)
    logits[1, [3, 9, 12]] = 1.0
    weights, ids = moe_topk(logits.to(device), 4, True)
    assert ids.cpu().tolist() == [[0, 1, 2, 3], [3, 9, 12, 0]]
    assert torch.allclose(weights[0].cpu(), torch.full((4,), 0.25))


def test_nan_logits_still_give_distinct_experts_in_range(device) -> None:
    """A NaN logit makes the row's softmax NaN: its weights are NaN, but each slot names one expert in range and
    no expert twice (a gather by a stray id would read past the experts' weights)."""
    logits = torch.randn(3, 128, generator=torch.Generator().manual_seed(5))
    logits[0, 7] = float("nan")
    logits[2] = float("nan")
    for renormalize in (True, False):
        weights, ids = moe_topk(logits.to(device), 8, renormalize)
        ids, weights = ids.cpu(), weights.cpu()
        assert ((ids >= 0) & (ids < 128)).all()
        assert all(len(set(row.tolist())) == 8 for row in ids)
        want_w, want_ids = ref_moe_topk(logits[1:2], 8, renormalize)
        assert torch.equal(ids[1], want_ids[0])
        torch.testing.assert_close(weights[1].double(), want_w[0], rtol=2e-6, atol=1e-7)
        # the NaN rows' weights are NaN, as a softmax over every expert makes them (never finite garbage)
        assert weights[0].isnan().all() and weights[2].isnan().all(), renormalize

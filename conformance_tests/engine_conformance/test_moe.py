"""Mixture of experts (``GemmBackend.prepare_experts`` / ``fused_moe``, the ``moe_topk`` op) against the
float64 references."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.ops import reference_ops
from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import assert_close, torch_dtype
from engine_conformance.op_checks import check_op_result
from engine_conformance.pytest_plugin import not_claimed, not_runnable
from engine_conformance.test_ops import moe_topk_case
from engine_plugin_sdk.quant import UnknownSchemeError, make_quantized_weight
from engine_plugin_sdk.reference_ops import ref_dequantize, ref_fused_moe, ref_moe_topk
from engine_plugin_sdk.tolerances import get_tolerance

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 128, 96, 6, 2
#: a decode-sized batch and one past 64 (token, expert) pairs: kernels often switch paths by batch size
TOKEN_COUNTS = (13, 37)


def moe_case(dtype: torch.dtype, device: Any, tokens: int) -> tuple[torch.Tensor, list, list, torch.Tensor, torch.Tensor]:
    """Fresh random experts and routing: the last expert gets no token, token 0 names expert 1 twice,
    and one token's weights do not sum to one (routings without renormalisation)."""
    gen = torch.Generator().manual_seed(4242 + tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype).to(device)
    gate_up = [(torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen) * HIDDEN**-0.5).to(dtype).to(device) for _ in range(EXPERTS)]
    down = [(torch.randn(HIDDEN, INTERMEDIATE, generator=gen) * INTERMEDIATE**-0.5).to(dtype).to(device) for _ in range(EXPERTS)]
    ids = torch.randint(0, EXPERTS - 1, (tokens, TOP_K), generator=gen)
    ids[0] = 1
    weights = torch.rand(tokens, TOP_K, generator=gen)
    weights[1:] = weights[1:] / weights[1:].sum(dim=-1, keepdim=True)
    return x, gate_up, down, weights.to(device), ids.to(device)


@pytest.mark.capability("moe.fused.{dtype_name}")
def test_fused_moe(platform: Platform, device: Any, dtype_name: str) -> None:
    capability = f"moe.fused.{dtype_name}"
    dtype = torch_dtype(dtype_name)
    gemm = platform.make_gemm_backend()
    for tokens in TOKEN_COUNTS:
        x, gate_up, down, weights, ids = moe_case(dtype, device, tokens)
        experts = gemm.prepare_experts(gate_up, down, dtype)
        out = gemm.fused_moe(x, experts, weights, ids)
        label = f"{capability} ({tokens} tokens)"
        if out.dtype != dtype or tuple(out.shape) != (tokens, HIDDEN):
            pytest.fail(f"{label}: output {out.dtype} {tuple(out.shape)}, expected {dtype} {(tokens, HIDDEN)}", pytrace=False)
        assert_close(out, ref_fused_moe(x, gate_up, down, weights, ids), get_tolerance(dtype), label)
    # no token at all: an empty output, not an error
    empty = gemm.fused_moe(x[:0], experts, weights[:0], ids[:0])
    if tuple(empty.shape) != (0, HIDDEN):
        pytest.fail(f"{capability}: no tokens gave shape {tuple(empty.shape)}", pytrace=False)


@pytest.mark.capability("moe.fused.swigluoai.{dtype_name}")
def test_fused_moe_with_biases_and_clamped_swiglu(platform: Platform, device: Any, dtype_name: str) -> None:
    """gpt-oss's experts: biases on both projections and its clamped SwiGLU; the gate/up products are drawn
    large enough (several times the clamp of 7) that a kernel which skips a clamp is off. The reference
    rounds the product to the model dtype as the backend's GEMM does (the activation's slope near the clamp
    would turn that rounding into more than the dtype's tolerance)."""
    capability = f"moe.fused.swigluoai.{dtype_name}"
    dtype = torch_dtype(dtype_name)
    gemm = platform.make_gemm_backend()
    for tokens in TOKEN_COUNTS:
        x, gate_up, down, weights, ids = moe_case(dtype, device, tokens)
        gen = torch.Generator().manual_seed(77 + tokens)
        gate_up = [(w.float() * 6.0).to(dtype) for w in gate_up]
        # the activations reach 8 * 7: smaller down weights keep the output near unit scale, where the
        # dtype's tolerance means what it means for the other rows
        down = [(w.float() / 8.0).to(dtype) for w in down]
        gate_up_bias = [torch.randn(2 * INTERMEDIATE, generator=gen).to(dtype).to(device) for _ in range(EXPERTS)]
        down_bias = [torch.randn(HIDDEN, generator=gen).to(dtype).to(device) for _ in range(EXPERTS)]
        experts = gemm.prepare_experts(gate_up, down, dtype, gate_up_bias, down_bias)
        out = gemm.fused_moe(x, experts, weights, ids, "swigluoai")
        expected = ref_fused_moe(x, gate_up, down, weights, ids, "swigluoai", gate_up_bias, down_bias, dtype)
        label = f"{capability} ({tokens} tokens)"
        if out.dtype != dtype or tuple(out.shape) != (tokens, HIDDEN):
            pytest.fail(f"{label}: output {out.dtype} {tuple(out.shape)}, expected {dtype} {(tokens, HIDDEN)}", pytrace=False)
        assert_close(out, expected, get_tolerance(dtype), label)


#: quantized experts: widths of a whole GGUF super-block (256) and of a grouped-integer test weight's groups (128)
QUANT_HIDDEN, QUANT_INTERMEDIATE = 256, 256


@pytest.mark.capability("moe.fused.quant.{quant_scheme}")
def test_fused_moe_with_quantized_experts(platform: Platform, caps: Capabilities, device: Any, quant_scheme: str) -> None:
    """Experts given as quantized weights of a claimed scheme (as a pre-quantized MoE checkpoint gives them: GPTQ /
    AWQ experts, a GGUF's expert stacks), whatever the backend keeps them as, against the float64 experts they
    stand for, at a decode-sized batch and one past 64 (token, expert) pairs, in each claimed dtype."""
    if quant_scheme == "any":
        not_claimed("no quantization schemes are claimed (weights are dequantized at load)")
    capability = f"moe.fused.quant.{quant_scheme}"
    try:
        gate_up = [make_quantized_weight(quant_scheme, 2 * QUANT_INTERMEDIATE, QUANT_HIDDEN, seed=500 + e, device=device)
                   for e in range(EXPERTS)]  # fmt: skip
        down = [make_quantized_weight(quant_scheme, QUANT_HIDDEN, QUANT_INTERMEDIATE, seed=600 + e, device=device)
                for e in range(EXPERTS)]  # fmt: skip
    except UnknownSchemeError as exc:
        not_runnable(str(exc))
    dense_gate_up, dense_down = [ref_dequantize(w) for w in gate_up], [ref_dequantize(w) for w in down]
    x_scale = float(torch.stack(dense_gate_up).std()) ** -1 * QUANT_HIDDEN**-0.5
    gemm = platform.make_gemm_backend()
    for dtype_name in caps.dtypes:
        dtype = torch_dtype(dtype_name)
        try:
            experts = gemm.prepare_experts(gate_up, down, dtype)
        except (ValueError, NotImplementedError, TypeError) as exc:
            pytest.fail(f"{capability}: claimed, but prepare_experts refused it in {dtype_name}: {exc}", pytrace=False)
        for tokens in TOKEN_COUNTS:
            gen = torch.Generator().manual_seed(4545 + tokens)
            # gate/up products of order one whatever the scheme's test weights' spread (random GGUF K-quant
            # blocks are up to five times wider than the others)
            x = (torch.randn(tokens, QUANT_HIDDEN, generator=gen) * x_scale).to(dtype).to(device)
            ids = torch.randint(0, EXPERTS - 1, (tokens, TOP_K), generator=gen)
            ids[0] = 1
            weights = torch.rand(tokens, TOP_K, generator=gen)
            out = gemm.fused_moe(x, experts, weights.to(device), ids.to(device))
            label = f"{capability} {dtype_name} ({tokens} tokens)"
            if out.dtype != dtype or tuple(out.shape) != (tokens, QUANT_HIDDEN):
                pytest.fail(f"{label}: output {out.dtype} {tuple(out.shape)}", pytrace=False)
            expected = ref_fused_moe(x, dense_gate_up, dense_down, weights, ids)
            assert_close(out, expected, get_tolerance(dtype, quantized=True), label)


@pytest.mark.capability("moe.topk")
def test_moe_topk_without_renormalisation(platform: Platform, caps: Capabilities) -> None:
    """The routing op over Qwen3-MoE's 128 experts with softmax weights kept as they are (Qwen2-MoE, OLMoE);
    ``ops.moe_topk`` covers 40 experts, renormalised."""
    op = reference_ops().with_overrides(platform.op_overrides()).moe_topk
    gen = torch.Generator().manual_seed(4343)
    for dtype_name in caps.dtypes:
        dtype = torch_dtype(dtype_name)
        args, expected = moe_topk_case(gen, dtype, platform.torch_device(), renormalize=False, experts=128)
        check_op_result("moe_topk", op(*args), expected, dtype, list(args), f"moe.topk {dtype_name}")


@pytest.mark.capability("moe.topk.grouped")
def test_moe_topk_sigmoid_grouped_with_bias(platform: Platform) -> None:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, a correction bias that moves the choice but not the
    weights, 64 experts in 8 groups of which the 3 best (sum of their two best choices) compete, top 6
    renormalised and scaled by 2.5; then the same without groups or renormalisation; then DeepSeek-V2's
    softmax routing over groups scored by their best expert, scaled by 16. float32 logits: the op scores in
    float32 whatever the model dtype, and fresh normal logits leave no near-ties."""
    op = reference_ops().with_overrides(platform.op_overrides()).moe_topk
    gen = torch.Generator().manual_seed(4444)
    device = platform.torch_device()
    logits = torch.randn(11, 64, generator=gen)
    bias = torch.randn(64, generator=gen) * 0.2
    cases = (
        (True, "sigmoid", bias, 8, 3, 2.5, "top2"), (False, "sigmoid", bias, 1, 1, 1.0, "top2"),
        (False, "softmax", None, 8, 3, 16.0, "max"),
    )  # fmt: skip
    for renormalize, scoring, with_bias, groups, topk_groups, scaling, group_score in cases:
        on_device = with_bias.to(device) if with_bias is not None else None
        args = (logits.to(device), 6, renormalize, scoring, on_device, groups, topk_groups, scaling, group_score)
        expected = ref_moe_topk(logits, 6, renormalize, scoring, with_bias, groups, topk_groups, scaling, group_score)
        label = f"moe.topk.grouped ({scoring}, {groups} groups by {group_score}, renormalize={renormalize})"
        check_op_result("moe_topk", op(*args), expected, torch.float32, list(args), label)

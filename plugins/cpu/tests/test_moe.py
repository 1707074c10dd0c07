"""The CPU plugin's mixture of experts: packed experts without bf16 copies, and the few-token path against the
SDK's per-expert product."""

from __future__ import annotations

import pytest
import torch

from engine_plugin_cpu.moe import FEW_TOKENS
from engine_plugin_cpu.platform import CpuPlatform
from engine_plugin_sdk import make_quantized_weight, reference_fused_moe

EXPERTS, HIDDEN, INTER = 4, 64, 32


@pytest.fixture(scope="module")
def gemm():
    return CpuPlatform().make_gemm_backend()


def _experts(gemm, biased: bool):
    gate_up = [make_quantized_weight("gguf_q8_0", 2 * INTER, HIDDEN, seed=e) for e in range(EXPERTS)]
    down = [make_quantized_weight("gguf_q8_0", HIDDEN, INTER, seed=100 + e) for e in range(EXPERTS)]
    gen = torch.Generator().manual_seed(7)
    biases = (
        ([torch.randn(2 * INTER, generator=gen).bfloat16() for _ in range(EXPERTS)],
         [torch.randn(HIDDEN, generator=gen).bfloat16() for _ in range(EXPERTS)])
        if biased else (None, None)
    )  # fmt: skip
    return gemm.prepare_experts(gate_up, down, "bfloat16", *biases), gate_up, down, biases


def test_experts_stay_packed_without_a_bf16_copy(gemm):
    if gemm.native is None:
        pytest.skip("no C kernels here")
    experts, *_ = _experts(gemm, biased=False)
    assert all(w.tiled is not None and w.dense is None for w in experts.gate_up + experts.down)


@pytest.mark.parametrize("tokens", [1, 3, FEW_TOKENS, FEW_TOKENS + 5])
@pytest.mark.parametrize(("activation", "biased"), [("silu", False), ("swigluoai", True)])
def test_fused_moe_matches_the_per_expert_product(gemm, tokens, activation, biased):
    experts, gate_up, down, (gate_up_bias, down_bias) = _experts(gemm, biased)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
    ids = torch.randint(0, EXPERTS, (tokens, 2), generator=gen)
    ids[0, 1] = ids[0, 0]  # a token naming one expert twice
    weights = torch.rand(tokens, 2, generator=gen)
    got = gemm.fused_moe(x, experts, weights, ids, activation).float()
    # float64 meaning: each slot's expert on the dequantized weights, weighted and summed
    want = torch.zeros(tokens, HIDDEN, dtype=torch.float64)
    for t in range(tokens):
        for j in range(2):
            e = int(ids[t, j])
            h = x[t].double() @ gate_up[e].dequantize().double().T
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].double()
            gate, up = h[:INTER], h[INTER:]
            if activation == "silu":
                a = torch.nn.functional.silu(gate) * up
            else:
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                a = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            y = a @ down[e].dequantize().double().T
            if down_bias is not None:
                y = y + down_bias[e].double()
            want[t] += float(weights[t, j]) * y
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() < 0.03 * scale
    sdk = reference_fused_moe(gemm, x, experts, weights, ids, activation).float()
    assert (got - sdk).abs().max().item() < 0.02 * scale

"""The shared mixture-of-experts kernels through the NVIDIA GEMM backend: both paths (GEMV for few slots, the
grouped GEMM for many), FP8 experts, and the grouping of slots by expert (interpreter on the CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_plugin_nvidia.gemm import CudaGemmBackend
from engine_plugin_sdk import QuantizedWeight
from engine_plugin_sdk.gpu.moe import StackedExperts
from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import (
    INTERPRETER_MOE_TILES,
    MoeTiles,
    align_slots,
    fused_moe,
)
from engine_plugin_sdk.reference_ops import ref_fused_moe
from engine_plugin_sdk.tolerances import compare, get_tolerance

HIDDEN, INTER, EXPERTS = 64, 48, 5
#: the grouped GEMM for every batch (no GEMV), with interpreter-sized tiles
GEMM_ONLY = MoeTiles(gemv_max_slots=0, gemm=((0, 16, 16, 16, 4, 1),), align_block_t=16)
#: the GEMV, its down kernel taking a token's experts together
AT_ONCE = dataclasses.replace(INTERPRETER_MOE_TILES, down_experts_at_once=True)


def backend(device: torch.device, tiles: MoeTiles) -> CudaGemmBackend:
    gemm = CudaGemmBackend(device, fp8=True)
    gemm.triton_moe, gemm.moe_tiles = True, tiles if device.type == "cpu" else None
    return gemm


def fp8_expert(w: torch.Tensor) -> tuple[QuantizedWeight, torch.Tensor]:
    """``w`` as an FP8 e4m3 weight with per-channel scales, and the float32 values it stands for."""
    scale = w.abs().amax(dim=1) / 448.0
    data = (w / scale[:, None]).to(torch.float8_e4m3fn)
    exact = data.float() * scale[:, None]
    return QuantizedWeight("fp8_e4m3", data, tuple(w.shape), lambda: exact, {"scale": scale}), exact


def routing(gen: torch.Generator, tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, EXPERTS, (tokens, top_k), generator=gen)
    ids[0] = 2  # one token names an expert twice
    return torch.rand(tokens, top_k, generator=gen), ids


@pytest.mark.parametrize(
    "tiles", [INTERPRETER_MOE_TILES, AT_ONCE, GEMM_ONLY], ids=["gemv", "gemv_experts_at_once", "grouped_gemm"]
)
def test_fp8_experts_stay_fp8_and_match_their_dequantized_values(device, tiles) -> None:
    gen = torch.Generator().manual_seed(11)
    pairs_gu = [fp8_expert(torch.randn(2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5) for _ in range(EXPERTS)]
    pairs_d = [fp8_expert(torch.randn(HIDDEN, INTER, generator=gen) * INTER**-0.5) for _ in range(EXPERTS)]
    gemm = backend(device, tiles)
    experts = gemm.prepare_experts([q for q, _ in pairs_gu], [q for q, _ in pairs_d], "float16")
    assert isinstance(experts, StackedExperts) and experts.gate_up.dtype == torch.float8_e4m3fn
    x = torch.randn(7, HIDDEN, generator=gen).half()
    weights, ids = routing(gen, 7, 3)
    out = gemm.fused_moe(x.to(device), experts, weights.to(device), ids.to(device))
    want = ref_fused_moe(x, [e for _, e in pairs_gu], [e for _, e in pairs_d], weights, ids)
    problem = compare(out.cpu(), want, get_tolerance(torch.float16), f"fp8 experts ({tiles.gemv_max_slots})")
    assert not problem, problem


@pytest.mark.parametrize("at_once", [False, True], ids=["expert_by_expert", "experts_at_once"])
def test_down_gemv_with_biases_over_several_reduction_tiles(device, at_once: bool) -> None:
    """Both down GEMVs (a token's experts one after another, or together as a tile dimension) against float64:
    biases on both projections, gpt-oss's activation, three reduction tiles of the expert width, top 3 (a
    padded expert dimension), a token naming one expert twice."""
    gen = torch.Generator().manual_seed(14)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * INTER**-0.5
    gate_up_bias = torch.randn(EXPERTS, 2 * INTER, generator=gen) * 0.1
    down_bias = torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.1
    x = torch.randn(3, HIDDEN, generator=gen)
    weights, ids = routing(gen, 3, 3)
    tiles = dataclasses.replace(INTERPRETER_MOE_TILES, down_gemv=(32, 16, 4), down_experts_at_once=at_once)
    got = fused_moe(x.to(device), gate_up.to(device), down.to(device), weights.to(device), ids.to(device), tiles,
                    activation="swigluoai", gate_up_bias=gate_up_bias.to(device), down_bias=down_bias.to(device))
    want = torch.zeros(3, HIDDEN, dtype=torch.float64)
    for t in range(3):
        for j in range(3):
            e = int(ids[t, j])
            gate, up = (gate_up[e].double() @ x[t].double() + gate_up_bias[e].double()).split(INTER)
            g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
            act = (u + 1.0) * g * torch.sigmoid(1.702 * g)
            want[t] += weights[t, j].double() * (down[e].double() @ act + down_bias[e].double())
    problem = compare(got.cpu(), want, get_tolerance(torch.float32), f"down GEMV (experts at once: {at_once})")
    assert not problem, problem


def test_quantized_experts_of_other_schemes_are_dequantized(device) -> None:
    """A scheme without FP8's or the grouped-integer kernels' form (an IQ2 type) is stacked dequantized."""
    gen = torch.Generator().manual_seed(12)
    gate_up = [torch.randn(2 * INTER, HIDDEN, generator=gen) * 0.1 for _ in range(EXPERTS)]
    down = [torch.randn(HIDDEN, INTER, generator=gen) * 0.1 for _ in range(EXPERTS)]
    wrapped = [QuantizedWeight("gguf_iq2_xxs", None, tuple(w.shape), lambda w=w: w) for w in gate_up]
    experts = backend(device, INTERPRETER_MOE_TILES).prepare_experts(wrapped, down, "float32")
    assert experts.gate_up.dtype == torch.float32
    assert torch.equal(experts.gate_up[3].cpu(), gate_up[3])


def test_align_groups_every_slot_once_under_its_expert(device) -> None:
    gen = torch.Generator().manual_seed(13)
    ids = torch.randint(0, 7, (150,), generator=gen)
    ids[ids == 4] = 5  # an expert without slots
    sorted_slots, block_expert, total = align_slots(ids.to(device), 7, 16, 16)
    sorted_slots, block_expert, total = sorted_slots.cpu(), block_expert.cpu(), int(total.item())
    counts = torch.bincount(ids, minlength=7)
    assert total == int(((counts + 15) // 16 * 16).sum())
    used = sorted_slots[:total].view(-1, 16)
    real = used[used < 150]
    assert sorted(real.tolist()) == list(range(150))
    for block, expert in zip(used, block_expert[: total // 16].tolist(), strict=True):
        slots = block[block < 150]
        assert (ids[slots] == expert).all() and slots.tolist() == sorted(slots.tolist())

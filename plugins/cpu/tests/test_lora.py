"""Batched LoRA on the CPU platform's GEMM backend against the float64 reference, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from engine_plugin_cpu.platform import CpuPlatform
from engine_plugin_sdk import GemmBackend, LoraStep, LoraWeights, get_tolerance, reference_add_lora
from engine_plugin_sdk.tolerances import compare

IN_FEATURES, OUT_FEATURES = 96, 200
#: per slot, the adapter's own rank (0: an empty slot), all padded to the largest
RANKS = (8, 3, 16, 0, 5)
ROW_COUNTS = (1, 7, 33)
DTYPES = (torch.float32, torch.bfloat16)


def random_adapters(gen: torch.Generator, out_features: int, dtype: torch.dtype) -> LoraWeights:
    """Random adapters of :data:`RANKS`, zero past each slot's rank, each with a scale of its own."""
    rank = max(RANKS)
    a = torch.zeros(len(RANKS), rank, IN_FEATURES)
    b = torch.zeros(len(RANKS), out_features, rank)
    for slot, r in enumerate(RANKS):
        # scaled so that the update is of order one: the tolerance table assumes outputs of that size
        a[slot, :r] = torch.randn(r, IN_FEATURES, generator=gen) * IN_FEATURES**-0.5
        b[slot, :, :r] = torch.randn(out_features, r, generator=gen) * max(r, 1) ** -0.5
    scales = torch.tensor([0.5 + 0.3 * slot if r else 0.0 for slot, r in enumerate(RANKS)])
    return LoraWeights(a.to(dtype), b.to(dtype), scales)


def step_of(slots: list[int], host: bool = True) -> LoraStep:
    return LoraStep(torch.tensor(slots, dtype=torch.int32), tuple(slots) if host else None, len(RANKS))


def slots_for(rows: int) -> list[int]:
    """Slots 4, 2, -1, 1, 0 in turn (the empty slot 3 is never read): out of order and repeated."""
    return [(4, 2, -1, 1, 0)[t % 5] for t in range(rows)]


@pytest.fixture(scope="module")
def gemm() -> GemmBackend:
    platform = CpuPlatform()
    assert platform.capabilities().lora
    return platform.make_gemm_backend()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("host", [True, False], ids=["host_plan", "device_plan"])
def test_add_lora_matches_the_reference(gemm: GemmBackend, dtype: torch.dtype, rows: int, host: bool) -> None:
    gen = torch.Generator().manual_seed(100 + rows)
    weights = random_adapters(gen, OUT_FEATURES, dtype)
    step = step_of(slots_for(rows), host)
    x = torch.randn(rows, IN_FEATURES, generator=gen).to(dtype)
    y = torch.randn(rows, OUT_FEATURES, generator=gen).to(dtype)
    expected = reference_add_lora(y, x, weights, step.token_slots)
    gemm.add_lora(y, x, weights, gemm.plan_lora(step))
    assert y.dtype == dtype
    assert compare(y, expected, get_tolerance(dtype), f"add_lora {dtype} {rows} rows") == ""


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_float32_logits_take_model_dtype_adapters(gemm: GemmBackend, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(200)
    weights = random_adapters(gen, OUT_FEATURES, dtype)
    step = step_of(slots_for(33))
    x = torch.randn(33, IN_FEATURES, generator=gen).to(dtype)
    logits = torch.randn(33, OUT_FEATURES, generator=gen)
    expected = reference_add_lora(logits, x, weights, step.token_slots)
    gemm.add_lora(logits, x, weights, gemm.plan_lora(step))
    assert logits.dtype == torch.float32
    # the inputs carry the model dtype's rounding, so its tolerance is the one that applies
    assert compare(logits, expected, get_tolerance(dtype), f"logits {dtype}") == ""


def test_one_plan_serves_every_projection_and_rows_without_adapters_are_untouched(gemm: GemmBackend) -> None:
    gen = torch.Generator().manual_seed(300)
    step = step_of([-1, 0, -1, 4, 4, -1])
    plan = gemm.plan_lora(step)
    x = torch.randn(6, IN_FEATURES, generator=gen)
    for out_features in (OUT_FEATURES, 48):
        weights = random_adapters(gen, out_features, torch.float32)
        y = torch.randn(6, out_features, generator=gen)
        before = y.clone()
        expected = reference_add_lora(y, x, weights, step.token_slots)
        gemm.add_lora(y, x, weights, plan)
        assert compare(y, expected, get_tolerance(torch.float32), f"out {out_features}") == ""
        assert torch.equal(y[[0, 2, 5]], before[[0, 2, 5]])
    none = step_of([-1] * 4)
    y = torch.randn(4, OUT_FEATURES, generator=gen)
    before = y.clone()
    gemm.add_lora(y, x[:4], random_adapters(gen, OUT_FEATURES, torch.float32), gemm.plan_lora(none))
    assert torch.equal(y, before)

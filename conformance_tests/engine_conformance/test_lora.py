"""Batched LoRA (``GemmBackend.plan_lora`` / ``add_lora``) against the float64 reference, for a platform that
claims ``Capabilities.lora``.

Every row draws fresh random adapters (never zeros, a distinct scale per slot) in each claimed dtype and
checks the in-place update ``y[t] += scales[s] * (x[t] @ a[s].T) @ b[s].T`` for ``s = token_slots[t] >= 0``.
One plan serves every projection of a step, as in the engine, so each row runs two projections on it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import assert_close, assert_equal, torch_dtype
from engine_conformance.pytest_plugin import not_claimed
from engine_plugin_sdk import LoraStep, LoraWeights, reference_add_lora
from engine_plugin_sdk.tolerances import Tolerance, get_tolerance

IN_FEATURES = 160
OUT_FEATURES = 288
#: a fused q/k/v projection: each part's A stacked along the rank, its B on the block diagonal
FUSED_PARTS = (128, 32, 32)
PART_RANK = 16
#: a slice of a vocabulary: the lm_head's float32 logits
VOCAB = 300
#: a decode row, a few, just over a 32-row tile
ROW_COUNTS = (1, 7, 33)
#: per slot, an adapter's own rank (0: an empty slot no row reads), padded to the largest
MIXED_RANKS = (16, 4, 9, 0)
#: twelve adapters of ranks 1 to 16 in fourteen slots (the last two empty)
MANY_RANKS = (8, 1, 16, 3, 12, 5, 16, 2, 7, 11, 4, 6, 0, 0)


def mixed_slots(rows: int) -> list[int]:
    """Slots 2, 1, 0 and -1 in turn: a single row reads slot 2 (neither the first slot nor the largest rank)."""
    return [(3 * t + 3) % 4 - 1 for t in range(rows)]


def scattered_slots(rows: int) -> list[int]:
    """Slots -1..11 out of order, each repeated every 13 rows, so that no slot's rows are adjacent."""
    return [(5 * t + 3) % 13 - 1 for t in range(rows)]


def random_lora(
    gen: torch.Generator, ranks: tuple[int, ...], parts: tuple[int, ...], dtype: torch.dtype, device: Any
) -> LoraWeights:
    """Adapters of the given per-slot ranks for a projection of ``parts`` outputs (one part: a plain projection).

    Each part gets a rank block of ``max(ranks)`` (``PART_RANK`` for a fused projection); a slot fills
    the first ``rank`` rows of A and columns of B of each block and leaves the padding zero. Scales are
    random in [0.25, 1.75] (0 for an empty slot), so a kernel that reads another slot's scale is off.
    """
    block = max(ranks) if len(parts) == 1 else PART_RANK
    a = torch.zeros(len(ranks), block * len(parts), IN_FEATURES)
    b = torch.zeros(len(ranks), sum(parts), block * len(parts))
    for slot, rank in enumerate(ranks):
        offset = 0
        for p, width in enumerate(parts):
            if rank:
                # scaled so that the shrunk values and the update are of order one, as the tolerances assume
                a[slot, p * block : p * block + rank] = (
                    torch.randn(rank, IN_FEATURES, generator=gen) * IN_FEATURES**-0.5
                )
                b[slot, offset : offset + width, p * block : p * block + rank] = (
                    torch.randn(width, rank, generator=gen) * rank**-0.5
                )
            offset += width
    scales = torch.where(torch.tensor(ranks) > 0, 0.25 + 1.5 * torch.rand(len(ranks), generator=gen), 0.0)
    return LoraWeights(a.to(dtype).to(device), b.to(dtype).to(device), scales.float().to(device))


def lora_step(slots: list[int], num_slots: int, device: Any, on_host: bool = True) -> LoraStep:
    """A step's slots on the device; on the host too unless the step stands for one being recorded."""
    token_slots = torch.tensor(slots, dtype=torch.int32, device=device)
    return LoraStep(token_slots, tuple(slots) if on_host else None, num_slots)


def check_add(
    gemm: Any, plan: Any, weights: LoraWeights, step: LoraStep, y: torch.Tensor, x: torch.Tensor, tol: Tolerance,
    label: str,
) -> None:  # fmt: skip
    """``add_lora`` on a copy of ``y`` against :func:`reference_add_lora`."""
    expected = reference_add_lora(y, x, weights, step.token_slots.cpu())
    out = y.clone()
    gemm.add_lora(out, x, weights, plan)
    if out.dtype != y.dtype or out.shape != y.shape:
        pytest.fail(f"{label}: y became {out.dtype} {tuple(out.shape)}", pytrace=False)
    assert_close(out, expected, tol, label)


def check_projections(
    gemm: Any, ranks: tuple[int, ...], slots: list[int], dtype: torch.dtype, device: Any, seed: int, label: str,
    on_host: bool = True,
) -> None:  # fmt: skip
    """One plan for the step, then a plain and a fused projection on it, each against the reference."""
    gen = torch.Generator().manual_seed(seed)
    plain = random_lora(gen, ranks, (OUT_FEATURES,), dtype, device)
    fused = random_lora(gen, ranks, FUSED_PARTS, dtype, device)
    step = lora_step(slots, len(ranks), device, on_host)
    plan = gemm.plan_lora(step)
    x = torch.randn(len(slots), IN_FEATURES, generator=gen).to(dtype).to(device)
    tol = get_tolerance(dtype)
    for name, weights in (("plain", plain), ("fused q/k/v", fused)):
        y = torch.randn(len(slots), weights.b.shape[1], generator=gen).to(dtype).to(device)
        check_add(gemm, plan, weights, step, y, x, tol, f"{label} ({len(slots)} rows, {name})")


def claimed_gemm(platform: Platform, caps: Capabilities) -> Any:
    """The platform's GEMM backend; skips as not claimed without ``Capabilities.lora``."""
    if not caps.lora:
        not_claimed("Capabilities.lora is False (the engine refuses enable_lora on this platform)")
    return platform.make_gemm_backend()


@pytest.mark.capability("lora.add.no_adapter.{dtype_name}")
def test_rows_without_adapters_leave_y_unchanged(
    platform: Platform, caps: Capabilities, device: Any, dtype_name: str
) -> None:
    capability = f"lora.add.no_adapter.{dtype_name}"
    gemm = claimed_gemm(platform, caps)
    dtype = torch_dtype(dtype_name)
    gen = torch.Generator().manual_seed(7100)
    weights = random_lora(gen, MIXED_RANKS, (OUT_FEATURES,), dtype, device)
    for rows in ROW_COUNTS:
        step = lora_step([-1] * rows, len(MIXED_RANKS), device)
        x = torch.randn(rows, IN_FEATURES, generator=gen).to(dtype).to(device)
        y = torch.randn(rows, OUT_FEATURES, generator=gen).to(dtype).to(device)
        out = y.clone()
        gemm.add_lora(out, x, weights, gemm.plan_lora(step))
        assert_equal(out, y, f"{capability} ({rows} rows)")


@pytest.mark.capability("lora.add.mixed_ranks.{dtype_name}")
def test_mixed_slots_and_ranks(platform: Platform, caps: Capabilities, device: Any, dtype_name: str) -> None:
    """Rows without an adapter between rows of three adapters of ranks 16, 4 and 9 padded to 16 (an empty
    fourth slot), on a plain projection and a fused q/k/v one of rank 3 x 16."""
    capability = f"lora.add.mixed_ranks.{dtype_name}"
    gemm = claimed_gemm(platform, caps)
    for rows in ROW_COUNTS:
        check_projections(
            gemm, MIXED_RANKS, mixed_slots(rows), torch_dtype(dtype_name), device, 7200 + rows, capability
        )


@pytest.mark.capability("lora.add.many_slots.{dtype_name}")
def test_many_slots_out_of_order(
    platform: Platform, caps: Capabilities, device: Any, dtype_name: str
) -> None:
    """Twelve adapters of ranks 1 to 16 in fourteen slots, rows reading them out of order and repeatedly."""
    capability = f"lora.add.many_slots.{dtype_name}"
    gemm = claimed_gemm(platform, caps)
    for rows in ROW_COUNTS:
        slots = scattered_slots(rows)
        check_projections(gemm, MANY_RANKS, slots, torch_dtype(dtype_name), device, 7300 + rows, capability)


@pytest.mark.capability("lora.add.logits_fp32.{dtype_name}")
def test_float32_logits_with_model_dtype_input(
    platform: Platform, caps: Capabilities, device: Any, dtype_name: str
) -> None:
    """The lm_head's case: ``y`` is float32 logits while ``x`` and the adapters are in the model dtype. Held
    to the model dtype's tolerance, the precision of the inputs."""
    capability = f"lora.add.logits_fp32.{dtype_name}"
    gemm = claimed_gemm(platform, caps)
    dtype = torch_dtype(dtype_name)
    gen = torch.Generator().manual_seed(7400)
    weights = random_lora(gen, MIXED_RANKS, (VOCAB,), dtype, device)
    for rows in ROW_COUNTS:
        step = lora_step(mixed_slots(rows), len(MIXED_RANKS), device)
        x = torch.randn(rows, IN_FEATURES, generator=gen).to(dtype).to(device)
        y = torch.randn(rows, VOCAB, generator=gen).to(device)
        label = f"{capability} ({rows} rows)"
        check_add(gemm, gemm.plan_lora(step), weights, step, y, x, get_tolerance(dtype), label)


@pytest.mark.capability("lora.add.graph_plan.{dtype_name}")
def test_plan_from_device_slots_only(
    platform: Platform, caps: Capabilities, device: Any, dtype_name: str
) -> None:
    """A plan made as while recording a graph (``token_slots_cpu=None``) gives the same result, with adapters
    and without."""
    capability = f"lora.add.graph_plan.{dtype_name}"
    gemm = claimed_gemm(platform, caps)
    dtype = torch_dtype(dtype_name)
    for rows in ROW_COUNTS:
        slots = mixed_slots(rows)
        check_projections(gemm, MIXED_RANKS, slots, dtype, device, 7500 + rows, capability, on_host=False)
    gen = torch.Generator().manual_seed(7550)
    weights = random_lora(gen, MIXED_RANKS, (OUT_FEATURES,), dtype, device)
    step = lora_step([-1] * 7, len(MIXED_RANKS), device, on_host=False)
    x = torch.randn(7, IN_FEATURES, generator=gen).to(dtype).to(device)
    y = torch.randn(7, OUT_FEATURES, generator=gen).to(dtype).to(device)
    out = y.clone()
    gemm.add_lora(out, x, weights, gemm.plan_lora(step))
    assert_equal(out, y, f"{capability} (7 rows without an adapter)")


#: decode-sized buckets, each recorded once; 3 rows run uncaptured (the eager fallback)
GRAPH_BUCKETS = (1, 8)


@pytest.mark.capability("lora.add.graph_replay.{dtype_name}")
def test_recorded_plan_reads_each_replays_slots(
    platform: Platform, caps: Capabilities, device: Any, dtype_name: str
) -> None:
    """Where the platform records graphs: ``plan_lora`` (slots on the device only) and ``add_lora`` recorded
    once per bucket with every row at -1, as the engine records its decode steps, then replayed twice per
    bucket with fresh slots and inputs. A plan that keeps the recording's slots fails."""
    capability = f"lora.add.graph_replay.{dtype_name}"
    gemm = claimed_gemm(platform, caps)
    if not caps.graph_capture:
        not_claimed("graph_capture is False: no step with adapters is ever recorded here")
    dtype = torch_dtype(dtype_name)
    gen = torch.Generator().manual_seed(7600)
    weights = random_lora(gen, MIXED_RANKS, (OUT_FEATURES,), dtype, device)

    def step(x: torch.Tensor, y: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        out = y.clone()
        gemm.add_lora(out, x, weights, gemm.plan_lora(LoraStep(token_slots, None, len(MIXED_RANKS))))
        return out

    def make_inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, IN_FEATURES, generator=gen).to(dtype).to(device)
        y = torch.randn(rows, OUT_FEATURES, generator=gen).to(dtype).to(device)
        return x, y, torch.full((rows,), -1, dtype=torch.int32, device=device)

    capture = platform.make_graph_capture()
    capture.capture(step, list(GRAPH_BUCKETS), make_inputs)
    tol = get_tolerance(dtype)
    for replay, rows in enumerate([*GRAPH_BUCKETS, *GRAPH_BUCKETS, 3]):
        x, y, _ = make_inputs(rows)
        # each replay reads other slots than the last one of its bucket did
        slots = torch.tensor(mixed_slots(rows + replay)[replay:], dtype=torch.int32, device=device)
        out = capture.run(rows, x, y, slots).clone()
        label = f"{capability} ({rows} rows, run {replay + 1})"
        assert_close(out, reference_add_lora(y, x, weights, slots.cpu()), tol, label)

"""The shared batched-LoRA kernels (shrink / expand) against the contract's float64 reference, and their
place in the NVIDIA GEMM backend (interpreter on the CPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine_plugin_nvidia.gemm import CudaGemmBackend
from engine_plugin_nvidia.platform import INTERPRET_ENV, CudaPlatform
from engine_plugin_sdk import LoraStep, LoraWeights, RowQuantizedActivations, reference_add_lora
from engine_plugin_sdk.gpu.fp8_gemm import quantize_rows as quantize_rows_pair
from engine_plugin_sdk.gpu.triton_kernels.lora_launchers import (
    INTERPRETER_LORA_TILES,
    LoraTiles,
    add_lora,
    lora_rank_block,
)
from engine_plugin_sdk.tolerances import compare, get_tolerance

SLOTS = 10
IN = 72  # not a multiple of any reduction tile: the last one is masked
OUT = 96  # not a power of two: the last column tile is masked
ROWS = (1, 5, 37)
#: 16-row blocks, 16-column reduction steps split 3 ways (5 steps: 2 + 2 + 1, the last one partial) and
#: 32-column output tiles: every mask and the split sum run even on tiny shapes
SPLIT_TILES = LoraTiles(block_m=((0, 16),), block_k=16, block_n=32, min_programs_per_slot=64, max_split_k=3)


def tiles_for(device: torch.device) -> LoraTiles:
    return INTERPRETER_LORA_TILES if device.type == "cpu" else LoraTiles()


def make_weights(
    rank: int, dtype: torch.dtype, gen: torch.Generator, in_features: int = IN, out_features: int = OUT
) -> LoraWeights:
    """Random adapters of order-one outputs; slot ``s`` uses only its first ``rank - s % 3 * 4`` ranks
    (zero-padded like an adapter of a smaller rank) and slot 3 is empty (scale 0)."""
    a = torch.randn(SLOTS, rank, in_features, generator=gen) / in_features**0.5
    b = torch.randn(SLOTS, out_features, rank, generator=gen) / rank**0.5
    for slot in range(SLOTS):
        own = max(1, rank - slot % 3 * 4)
        a[slot, own:] = 0
        b[slot, :, own:] = 0
    scales = torch.rand(SLOTS, generator=gen) + 0.5
    scales[3] = 0.0
    return LoraWeights(a.to(dtype), b.to(dtype), scales)


def make_slots(rows: int, gen: torch.Generator) -> torch.Tensor:
    """Each row's slot, about a fifth of them -1; never all -1 when there are several rows."""
    slots = torch.randint(-1, SLOTS, (rows,), generator=gen)
    slots[torch.rand(rows, generator=gen) < 0.1] = -1
    if rows > 1:
        slots[rows // 2] = 7
    return slots.to(torch.int32)


def on(device: torch.device, weights: LoraWeights) -> LoraWeights:
    return LoraWeights(weights.a.to(device), weights.b.to(device), weights.scales.to(device))


def check(
    y: torch.Tensor,
    x: torch.Tensor,
    weights: LoraWeights,
    slots: torch.Tensor,
    run: Callable[[torch.Tensor, torch.Tensor, LoraWeights, torch.Tensor], None],
    device: torch.device,
    dtype: torch.dtype,
    what: str,
) -> None:
    """Run ``run(y, x, weights, slots)`` on copies on ``device`` and compare with the float64 reference
    (held to ``dtype``'s tolerance); rows without a slot must come back bit for bit."""
    device_y = y.clone().to(device)
    run(device_y, x.to(device), on(device, weights), slots.to(device))
    assert device_y.dtype == y.dtype
    expected = reference_add_lora(y, x, weights, slots)
    problem = compare(device_y, expected, get_tolerance(dtype), what)
    assert not problem, problem
    untouched = (slots < 0).nonzero().flatten()
    assert torch.equal(device_y.cpu()[untouched], y[untouched]), f"{what}: a row without a slot changed"


def launcher(tiles: LoraTiles) -> Callable[[torch.Tensor, torch.Tensor, LoraWeights, torch.Tensor], None]:
    """The launcher with fixed tiles."""
    return lambda y, x, weights, slots: add_lora(y, x, weights, slots, tiles)


@pytest.mark.parametrize("rank", [8, 48])
def test_kernels_match_float64_reference(device, kernel_dtypes, rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    run = launcher(tiles_for(device))
    for dtype in kernel_dtypes:
        weights = make_weights(rank, dtype, gen)
        for rows in ROWS:
            x = torch.randn(rows, IN, generator=gen).to(dtype)
            y = torch.randn(rows, OUT, generator=gen).to(dtype)
            check(
                y, x, weights, make_slots(rows, gen), run, device, dtype, f"rank {rank} {dtype} rows {rows}"
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_reduction_and_partial_tiles(device, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    weights = make_weights(16, dtype, gen)
    run = launcher(SPLIT_TILES)
    for rows in (1, 37):
        x = torch.randn(rows, IN, generator=gen).to(dtype)
        y = torch.randn(rows, OUT, generator=gen).to(dtype)
        check(y, x, weights, make_slots(rows, gen), run, device, dtype, f"split {dtype} rows {rows}")


def test_float32_logits_from_float16_inputs(device) -> None:
    gen = torch.Generator().manual_seed(3)
    weights = make_weights(8, torch.float16, gen, out_features=200)
    x = torch.randn(5, IN, generator=gen).half()
    y = torch.randn(5, 200, generator=gen)
    # float32 out, but the products ran in float16: the float16 tolerance
    run = launcher(tiles_for(device))
    check(y, x, weights, make_slots(5, gen), run, device, torch.float16, "logits")


def test_strided_output_rows(device) -> None:
    # a slice of a fused projection's output: rows further apart than its width
    gen = torch.Generator().manual_seed(5)
    weights = make_weights(8, torch.float32, gen)
    x = torch.randn(5, IN, generator=gen)
    before = torch.randn(5, OUT + 40, generator=gen)
    wide = before.clone().to(device)
    slots = make_slots(5, gen)
    expected = reference_add_lora(before[:, 24 : 24 + OUT], x, weights, slots)
    add_lora(wide[:, 24 : 24 + OUT], x.to(device), on(device, weights), slots.to(device), tiles_for(device))
    problem = compare(wide[:, 24 : 24 + OUT], expected, get_tolerance(torch.float32), "strided y")
    assert not problem, problem
    # the columns around the slice are another projection's
    assert torch.equal(wide[:, :24].cpu(), before[:, :24]) and torch.equal(
        wide[:, 24 + OUT :].cpu(), before[:, 24 + OUT :]
    )


def test_rows_without_slots_leave_y_unchanged(device) -> None:
    gen = torch.Generator().manual_seed(8)
    weights = on(device, make_weights(48, torch.float16, gen))
    for rows in (1, 37):
        x = torch.randn(rows, IN, generator=gen).half().to(device)
        y = torch.randn(rows, OUT, generator=gen).half().to(device)
        before = y.clone()
        add_lora(y, x, weights, torch.full((rows,), -1, dtype=torch.int32, device=device), tiles_for(device))
        assert torch.equal(y, before)


def test_tiles_fit_wide_ranks_and_float32() -> None:
    tiles = LoraTiles()
    # decode: the full step; a tall block of float32 rows or a wide rank: narrower steps in the same bytes
    assert tiles.shrink_block_k(16, 16, 2, 2, 4096) == 128 and tiles.shrink_block_k(64, 16, 4, 4, 4096) == 32
    assert tiles.shrink_block_k(64, 256, 2, 2, 4096) == 16 and tiles.shrink_block_k(16, 16, 2, 2, 40) == 64
    assert tiles.expand_block_n(16, 4096) == 128 and tiles.expand_block_n(256, 4096) == 32
    assert tiles.expand_block_n(16, 20) == 32


def test_rank_pads_to_a_dot_tile() -> None:
    assert [lora_rank_block(r) for r in (1, 8, 16, 17, 48, 64)] == [16, 16, 16, 32, 64, 64]
    assert (
        SPLIT_TILES.split_k(3, 5) == 3
        and LoraTiles().split_k(1, 32) == 16
        and LoraTiles().split_k(64, 32) == 1
    )


def test_backend_plans_on_the_device_and_adds(device) -> None:
    gemm = CudaGemmBackend(device)
    gemm.triton_lora, gemm.lora_tiles = True, tiles_for(device)
    gen = torch.Generator().manual_seed(21)
    weights = make_weights(48, torch.float16, gen)
    slots = make_slots(5, gen)
    # no host copy of the slots, as while a graph is recorded: the plan must not need one
    plan = gemm.plan_lora(LoraStep(slots.long().to(device), None, SLOTS))
    # the rows in slot order, each position naming its row
    assert plan.slots.dtype == torch.int32 and plan.order.dtype == torch.int32
    assert torch.equal(plan.slots.cpu(), torch.sort(slots, stable=True).values)
    assert torch.equal(slots[plan.order.cpu().long()], plan.slots.cpu())
    x = torch.randn(5, IN, generator=gen).half()
    y = torch.randn(5, OUT, generator=gen).half()

    run = lambda y_dev, x_dev, w_dev, _slots: gemm.add_lora(y_dev, x_dev, w_dev, plan)  # noqa: E731
    check(y, x, weights, slots, run, device, torch.float16, "backend")
    # FP8 rows (a W8A8 projection's input) are dequantized first
    data, scale = quantize_rows_pair(x.float(), torch.float8_e4m3fn)
    dequantized = (data.float() * scale).half()
    fp8_x = RowQuantizedActivations(data.to(device), scale.to(device), torch.float16)
    got = y.clone().to(device)
    gemm.add_lora(got, fp8_x, on(device, weights), plan)
    problem = compare(
        got, reference_add_lora(y, dequantized, weights, slots), get_tolerance(torch.float16), "fp8"
    )
    assert not problem, problem


def test_without_triton_the_default_plan_runs() -> None:
    gemm = CudaGemmBackend(torch.device("cpu"))
    assert not gemm.triton_lora
    gen = torch.Generator().manual_seed(2)
    weights = make_weights(8, torch.float32, gen)
    slots = make_slots(5, gen)
    x, y = torch.randn(5, IN, generator=gen), torch.randn(5, OUT, generator=gen)
    plan = gemm.plan_lora(LoraStep(slots, tuple(slots.tolist()), SLOTS))
    got = y.clone()
    gemm.add_lora(got, x, weights, plan)
    problem = compare(got, reference_add_lora(y, x, weights, slots), get_tolerance(torch.float32), "default")
    assert not problem, problem


def test_interpreter_claims_lora_and_its_backend_runs_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRET_ENV, "1")
    platform = CudaPlatform()
    if not platform.interpret:
        pytest.skip("a GPU is visible: the platform is not in interpreter mode")
    assert platform.capabilities().lora
    gemm = platform.make_gemm_backend()
    assert gemm.triton_lora and gemm.lora_tiles == INTERPRETER_LORA_TILES

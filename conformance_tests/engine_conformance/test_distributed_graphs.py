"""The ``distributed.graph_capture`` row: collectives inside recorded graphs
(``Capabilities.graph_capture_collectives``), two ranks spawned as the other ``distributed`` rows are
(:mod:`engine_conformance.test_distributed`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.pytest_plugin import PlatformTarget
from engine_conformance.test_distributed import (
    WORLD,
    TwoRankRun,
    _need_two_devices,
    _rank_device,
    _spawn_ranks,
    rank_record,
    unclaimed,
)
from engine_plugin_sdk.tolerances import compare, get_tolerance

#: the graph row's buckets: two, so that a capture replaying another bucket's graph shows
GRAPH_BUCKETS = (2, 4)
#: a batch size between them that no graph holds: the documented eager fallback, collectives included
GRAPH_UNCAPTURED = 3
#: replays of each bucket, each on fresh inputs (a replay must read its new inputs, and its collectives
#: must exchange them again, not hand back what they exchanged while recording)
GRAPH_ROUNDS = 2
GRAPH_WIDTH = 16
#: compiling the step (torch.compile on the CPU) can take a minute on a small host before any replay
GRAPH_RUN_TIMEOUT_S = 300.0


def graph_steps() -> list[tuple[str, int, str]]:
    """``(key, batch size, label)`` of every run of the graph row, in the order every rank makes them."""
    steps = [
        (f"replay{r}_bs{bs}", bs, f"replay {r + 1} of bucket {bs}")
        for r in range(GRAPH_ROUNDS)
        for bs in GRAPH_BUCKETS
    ]
    return [
        *steps,
        (f"eager_bs{GRAPH_UNCAPTURED}", GRAPH_UNCAPTURED, f"batch size {GRAPH_UNCAPTURED}, no graph"),
    ]


def _graph_rank_main(
    platform_cls: type[Platform], rank: int, init_method: str, out_dir: str, dtype_name: str
) -> None:
    """One rank of the graph row: record a step holding an all-reduce and an all-gather, then run it on
    fresh inputs, saving after each run (a hang keeps what came before)."""
    saved, save = rank_record(out_dir, rank)
    try:
        platform = platform_cls()
        comm = platform.make_communicator(WORLD, rank, init_method, local_rank=rank)
        device = _rank_device(platform, rank)
        capture = platform.make_graph_capture()
    except Exception as exc:
        saved["errors"]["setup"] = f"make_communicator/make_graph_capture raised {type(exc).__name__}: {exc}"
        save()
        return
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(4321 + 97 * rank)
    weight = (torch.randn(GRAPH_WIDTH, GRAPH_WIDTH, generator=gen) * GRAPH_WIDTH**-0.5).to(dtype)
    saved["inputs"]["weight"] = weight
    w = weight.to(device)

    def step(x: torch.Tensor) -> torch.Tensor:
        # this rank's share of a row-parallel projection summed over the ranks in place (tensor parallelism's
        # all-reduce), then every rank's rows side by side (its all-gather); adding x after the sum makes
        # each rank's part of the gather its own, so rank order and every rank's fresh input both show
        total = comm.all_reduce(torch.nn.functional.silu(x @ w))
        return comm.all_gather(total + x, dim=-1)

    def make_inputs(batch_size: int) -> tuple[torch.Tensor]:
        return (torch.randn(batch_size, GRAPH_WIDTH, generator=gen).to(dtype).to(device),)

    try:
        capture.capture(step, list(GRAPH_BUCKETS), make_inputs)
        saved["outputs"]["captured"] = sorted(int(b) for b in capture.captured_batch_sizes())
    except Exception as exc:
        saved["errors"]["capture"] = f"capture raised {type(exc).__name__}: {exc}"
    save()
    if "capture" not in saved["errors"]:
        for key, batch_size, _ in graph_steps():
            x = torch.randn(batch_size, GRAPH_WIDTH, generator=gen).to(dtype)
            saved["inputs"][key] = x
            try:
                out = capture.run(batch_size, x.clone().to(device))
                # a replay hands back the graph's output buffer, which the next replay overwrites: copy it now
                saved["outputs"][key] = out.detach().to("cpu").clone()
            except Exception as exc:
                saved["errors"][key] = f"run raised {type(exc).__name__}: {exc}"
                save()
                break  # the peer may wait in a collective this rank never joins: leaving closes the group
            save()
    try:
        comm.close()
    except Exception:  # closing is the other rows' subject; the results are saved already
        pass


def _graph_reference(inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    """The graph row's step in float64 from every rank's input and weight (every rank returns it)."""
    total = torch.stack(
        [torch.nn.functional.silu(x.double() @ w.double()) for x, w in zip(inputs, weights, strict=True)]
    ).sum(dim=0)
    return torch.cat([total + x.double() for x in inputs], dim=-1)


def check_graph_run(run: TwoRankRun, capability: str, dtype_name: str) -> None:
    """Fail with a message starting with ``capability`` unless every rank recorded every bucket and every
    run of the step, replayed or eager, matches the float64 reference."""
    for rank, saved in enumerate(run.ranks):
        for stage in ("setup", "capture"):
            if stage in saved["errors"]:
                pytest.fail(f"{capability}: rank {rank}: {saved['errors'][stage]}", pytrace=False)
        captured = saved["outputs"].get("captured")
        if captured is None:
            why = run.problem or "its process stopped before"
            pytest.fail(f"{capability}: rank {rank} did not finish recording: {why}", pytrace=False)
        missing = sorted(set(GRAPH_BUCKETS) - set(captured))
        if missing:
            pytest.fail(
                f"{capability}: rank {rank}: buckets {missing} were not captured (captured: {captured})",
                pytrace=False,
            )
    weights = [saved["inputs"]["weight"] for saved in run.ranks]
    tol = get_tolerance(dtype_name)
    for key, _, label in graph_steps():
        for rank, saved in enumerate(run.ranks):
            if key in saved["errors"]:
                pytest.fail(f"{capability}: rank {rank}, {label}: {saved['errors'][key]}", pytrace=False)
            if key not in saved["outputs"]:
                why = run.problem or "its process stopped before"
                pytest.fail(f"{capability}: rank {rank} did not finish {label}: {why}", pytrace=False)
        expected = _graph_reference([saved["inputs"][key] for saved in run.ranks], weights)
        for rank, saved in enumerate(run.ranks):
            got = saved["outputs"][key]
            if got.dtype != weights[0].dtype:
                pytest.fail(f"{capability}: rank {rank}, {label}: dtype {got.dtype}, not {weights[0].dtype}",
                            pytrace=False)  # fmt: skip
            mismatch = compare(got, expected, tol, f"{capability} (rank {rank}, {label})")
            if mismatch:
                pytest.fail(mismatch, pytrace=False)


@pytest.mark.capability("distributed.graph_capture")
def test_graph_capture_collectives(
    platform_target: PlatformTarget, platform: Platform, caps: Capabilities, record_property: Any
) -> None:
    """Two ranks record a step holding an all-reduce and an all-gather through ``make_graph_capture`` and
    replay it in lockstep on fresh inputs, as tensor-parallel decode graphs do
    (``engine.parallel.rank_graphs``): every replay, and the eager fallback, must match the float64
    reference on every rank."""
    capability = "distributed.graph_capture"
    if unclaimed(platform, caps, capability, record_property):
        return
    if not caps.graph_capture_collectives:
        record_property(
            "not_claimed", "'graph_capture_collectives' not claimed: tensor-parallel ranks run eagerly"
        )
        return
    if not caps.graph_capture:
        # the engine records nothing without graph_capture, so the claim has nothing to hold
        record_property(
            "not_claimed", "'graph_capture_collectives' claimed without 'graph_capture': no graphs"
        )
        return
    _need_two_devices(platform)
    dtype_name = "float32" if "float32" in caps.dtypes else caps.dtypes[0]
    run = _spawn_ranks(_graph_rank_main, platform_target.cls, (dtype_name,), GRAPH_RUN_TIMEOUT_S)
    check_graph_run(run, capability, dtype_name)

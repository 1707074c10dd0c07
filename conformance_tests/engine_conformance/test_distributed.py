"""Collectives (tensor, pipeline and expert parallelism): two ranks against the float64 references.

Every row but the last reads one shared run per platform: two spawned processes, each building its
communicator with ``platform.make_communicator(2, rank, "tcp://127.0.0.1:<port>", local_rank=rank)`` on
the platform's device, perform every collective in one fixed order on fresh random inputs (seeded per
rank) and save their inputs and outputs after each step. One spawn for all rows keeps the file a few
seconds on a CPU. A platform that does not claim ``distributed`` must refuse ``make_communicator``
(NotImplementedError).

``distributed.graph_capture`` (``Capabilities.graph_capture_collectives``) spawns its own two ranks, only
where it is claimed: each records a step holding an all-reduce and an all-gather through
``platform.make_graph_capture()`` and replays it on fresh inputs, against the float64 reference.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from engine.interfaces.platform import Capabilities, Platform
from engine.ports import free_port
from engine_conformance.pytest_plugin import PlatformTarget, not_runnable
from engine_plugin_sdk.reference_collectives import (
    reference_all_gather,
    reference_all_reduce,
    reference_all_to_all,
    reference_reduce_scatter,
)
from engine_plugin_sdk.tolerances import Tolerance, compare, get_tolerance

WORLD = 2
#: a rank that has not finished by then is stuck in a collective its peer never joined
RUN_TIMEOUT_S = 180.0
EXACT = Tolerance(atol=0.0, rtol=0.0, logits_atol=0.0)
#: step -> (input shape, dim) for the steps with a dim; every dim divisible by WORLD where it must be
SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    "all_reduce": ((8, 33), 0),
    "all_reduce_bf16": ((8, 33), 0),
    "all_gather_last": ((3, 5), -1),
    "all_gather_0": ((4, 3, 2), 0),
    "reduce_scatter_0": ((8, 6), 0),
    "reduce_scatter_1": ((3, 10), 1),
    "broadcast": ((5, 7), 1),  # the dim is the source rank here
    "send_recv": ((6, 4), 0),
    "all_to_all": ((6, 5), 0),
    # split: one group of both ranks listed in reverse (still numbered in ascending order), then two of one
    "split_all_gather": ((2, 3), 0),
    "split_broadcast": ((4, 3), 0),
    "split_single": ((3, 3), 0),
}


@dataclass(slots=True)
class TwoRankRun:
    """What the two ranks saved: per rank, the inputs, outputs and errors of each step they reached."""

    ranks: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    problem: str = ""


_RUNS: dict[str, TwoRankRun] = {}


def _rank_device(platform: Platform, rank: int) -> torch.device:
    device = torch.device(platform.torch_device())
    return device if device.type == "cpu" else torch.device(device.type, rank)


def rank_record(out_dir: str, rank: int) -> tuple[dict[str, dict[str, Any]], Callable[[], None]]:
    """A rank's record of its steps (inputs, outputs, errors by step) and the call that saves it whole to
    ``rank{rank}.pt`` (written aside, then renamed: a rank killed mid-save leaves the last full record)."""
    saved: dict[str, dict[str, Any]] = {"inputs": {}, "outputs": {}, "errors": {}}
    path = os.path.join(out_dir, f"rank{rank}.pt")

    def save() -> None:
        torch.save(saved, path + ".tmp")
        os.replace(path + ".tmp", path)

    return saved, save


def _rank_main(platform_cls: type[Platform], rank: int, init_method: str, out_dir: str, bf16: bool) -> None:
    """One rank: every collective in the suite's order, saving after each step (a hang keeps the rest)."""
    saved, save = rank_record(out_dir, rank)
    try:
        platform = platform_cls()
        comm = platform.make_communicator(WORLD, rank, init_method, local_rank=rank)
        device = _rank_device(platform, rank)
    except Exception as exc:  # every row reports it
        saved["errors"]["setup"] = f"make_communicator raised {type(exc).__name__}: {exc}"
        save()
        return
    gen = torch.Generator().manual_seed(1234 + 97 * rank)

    def step(
        name: str, op: Callable[[torch.Tensor], torch.Tensor | None], dtype: torch.dtype = torch.float32
    ) -> None:
        x = torch.randn(SHAPES[name][0], generator=gen).to(dtype)
        saved["inputs"][name] = x
        try:
            out = op(x.clone().to(device))
            saved["outputs"][name] = None if out is None else out.detach().to("cpu").clone()
        except Exception as exc:
            saved["errors"][name] = f"{type(exc).__name__}: {exc}"
        save()

    def send_recv(x: torch.Tensor) -> torch.Tensor:
        # rank 0 -> rank 1, then rank 1 -> rank 0: each rank returns what it received
        peer = 1 - rank
        buf = torch.empty_like(x)
        if rank == 0:
            comm.send(x, peer)
            return comm.recv(buf, peer)
        received = comm.recv(buf, peer)
        comm.send(x, peer)
        return received

    step("all_reduce", comm.all_reduce)
    if bf16:
        step("all_reduce_bf16", comm.all_reduce, torch.bfloat16)
    step("all_gather_last", lambda x: comm.all_gather(x, dim=-1))
    step("all_gather_0", lambda x: comm.all_gather(x, dim=0))
    step("reduce_scatter_0", lambda x: comm.reduce_scatter(x, dim=0))
    step("reduce_scatter_1", lambda x: comm.reduce_scatter(x, dim=1))
    step("broadcast", lambda x: comm.broadcast(x, src=SHAPES["broadcast"][1]))
    step("send_recv", send_recv)
    step("all_to_all", comm.all_to_all)
    try:  # every rank splits alike, in the same order (the contract)
        reversed_group, singles = comm.split([[1, 0]]), comm.split([[0], [1]])
    except Exception as exc:
        for name in ("split_all_gather", "split_broadcast", "split_single"):
            saved["errors"][name] = f"split raised {type(exc).__name__}: {exc}"
    else:
        step("split_all_gather", lambda x: reversed_group.all_gather(x, dim=0))
        step("split_broadcast", lambda x: reversed_group.broadcast(x, src=0))

        def single(x: torch.Tensor) -> torch.Tensor:
            if (singles.world_size, singles.rank) != (1, 0):
                raise AssertionError(f"a group of one has world_size {singles.world_size}, rank {singles.rank}")
            return singles.all_reduce(x)

        step("split_single", single)
    # refusals are local: a rank must raise before it sends anything
    for name, op in (
        ("reduce_scatter_indivisible", lambda: comm.reduce_scatter(torch.ones(3, 2, device=device), dim=0)),
        ("all_to_all_indivisible", lambda: comm.all_to_all(torch.ones(5, 2, device=device))),
    ):
        try:
            op()
            saved["errors"][name] = (
                "accepted a dim not divisible by the world size instead of raising ValueError"
            )
        except ValueError:
            saved["outputs"][name] = None
        except Exception as exc:
            saved["errors"][name] = f"raised {type(exc).__name__} instead of ValueError: {exc}"
    try:
        comm.barrier()
        comm.close()
        comm.close()  # the contract: safe twice
        saved["outputs"]["close"] = None
    except Exception as exc:
        saved["errors"]["close"] = f"barrier/close raised {type(exc).__name__}: {exc}"
    save()


def _need_two_devices(platform: Platform) -> None:
    """Skip as "not runnable here" unless two ranks can each drive a device of the platform's type."""
    device = torch.device(platform.torch_device())
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    try:
        count = int(module.device_count()) if module is not None else 0
    except Exception:  # a device module without a count cannot place two ranks either
        count = 0
    if count < WORLD:
        not_runnable(f"two ranks need {WORLD} {device.type} devices; {count} visible")


def _spawn_ranks(
    main: Callable[..., None], platform_cls: type[Platform], args: tuple, timeout_s: float
) -> TwoRankRun:
    """Run ``main(platform_cls, rank, init_method, out_dir, *args)`` in one spawned process per rank and
    read what each saved to ``<out_dir>/rank<rank>.pt``, whatever became of the processes."""
    run = TwoRankRun()
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="engine-distributed-") as out_dir:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        procs = [
            ctx.Process(target=main, args=(platform_cls, rank, init_method, out_dir, *args), daemon=True)
            for rank in range(WORLD)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        stuck = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for rank in stuck:
            procs[rank].kill()
            procs[rank].join()
        if stuck:
            run.problem = f"rank(s) {stuck} did not finish within {timeout_s:g} s (a collective hung)"
        elif any(proc.exitcode for proc in procs):
            run.problem = f"the ranks exited with codes {[proc.exitcode for proc in procs]}"
        for rank in range(WORLD):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            run.ranks.append(
                torch.load(path) if os.path.exists(path) else {"inputs": {}, "outputs": {}, "errors": {}}
            )
    return run


def two_rank_run(target: PlatformTarget, platform: Platform, caps: Capabilities) -> TwoRankRun:
    """The platform's shared two-process run (once per test process), or "not runnable here"."""
    _need_two_devices(platform)
    if target.name not in _RUNS:
        bf16 = "bfloat16" in caps.dtypes
        _RUNS[target.name] = _spawn_ranks(_rank_main, target.cls, (bf16,), RUN_TIMEOUT_S)
    return _RUNS[target.name]


def _expected(name: str, inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    dim = SHAPES[name][1] if name in SHAPES else 0
    if name.startswith("all_reduce"):
        return reference_all_reduce(inputs)
    if name.startswith("all_gather"):
        return reference_all_gather(inputs, dim)
    if name.startswith("reduce_scatter"):
        return reference_reduce_scatter(inputs, rank, dim)
    if name == "broadcast":
        return inputs[dim].to(torch.float64)
    if name == "send_recv":
        return inputs[1 - rank].to(torch.float64)
    if name == "split_all_gather":
        return reference_all_gather(inputs, 0)  # in ascending rank order, not the list's
    if name == "split_broadcast":
        return inputs[0].to(torch.float64)  # the group's rank 0 is the lowest rank, world rank 0
    if name == "split_single":
        return inputs[rank].to(torch.float64)  # a group of one: its own tensor
    return reference_all_to_all(inputs, rank)


def check_steps(run: TwoRankRun, capability: str, steps: list[str]) -> None:
    """Fail with a message starting with ``capability`` unless every rank's every step matches."""
    for rank, saved in enumerate(run.ranks):
        if "setup" in saved["errors"]:
            pytest.fail(f"{capability}: rank {rank}: {saved['errors']['setup']}", pytrace=False)
    for name in steps:
        for rank, saved in enumerate(run.ranks):
            if name in saved["errors"]:
                pytest.fail(f"{capability}: rank {rank}, {name}: {saved['errors'][name]}", pytrace=False)
            if name not in saved["outputs"]:
                why = run.problem or "its process stopped before"
                pytest.fail(f"{capability}: rank {rank} did not finish {name}: {why}", pytrace=False)
            if name not in SHAPES:
                continue  # a refusal or close: no tensor to compare
            inputs = [r["inputs"][name] for r in run.ranks]
            tol = get_tolerance(inputs[0].dtype) if "reduce" in name else EXACT
            got = saved["outputs"][name]
            if got.dtype != inputs[0].dtype:
                pytest.fail(
                    f"{capability}: rank {rank}, {name}: dtype {got.dtype}, not {inputs[0].dtype}",
                    pytrace=False,
                )
            mismatch = compare(got, _expected(name, inputs, rank), tol, f"{capability} (rank {rank}, {name})")
            if mismatch:
                pytest.fail(mismatch, pytrace=False)


def unclaimed(platform: Platform, caps: Capabilities, capability: str, record_property: Any) -> bool:
    """True (recording why) when ``distributed`` is not claimed and ``make_communicator`` refuses; fails when
    it is not claimed yet a communicator is built."""
    if caps.distributed:
        return False
    try:
        comm = platform.make_communicator(1, 0, f"tcp://127.0.0.1:{free_port()}")
    except NotImplementedError as exc:
        record_property("not_claimed", f"'distributed' not claimed; make_communicator refused: {exc}")
        return True
    comm.close()
    pytest.fail(
        f"{capability}: 'distributed' is not claimed, yet make_communicator returned {type(comm).__name__} "
        "instead of raising NotImplementedError",
        pytrace=False,
    )


def run_row(
    platform_target: PlatformTarget,
    platform: Platform,
    caps: Capabilities,
    record_property: Any,
    capability: str,
    steps: list[str],
) -> None:
    """One row: the claim, then ``steps`` of the shared two-rank run."""
    if unclaimed(platform, caps, capability, record_property):
        return
    check_steps(two_rank_run(platform_target, platform, caps), capability, steps)


@pytest.mark.capability("distributed.all_reduce")
def test_all_reduce(
    platform_target: PlatformTarget, platform: Platform, caps: Capabilities, record_property: Any
) -> None:
    steps = ["all_reduce"] + (["all_reduce_bf16"] if "bfloat16" in caps.dtypes else [])
    run_row(platform_target, platform, caps, record_property, "distributed.all_reduce", steps)


@pytest.mark.capability("distributed.all_gather")
def test_all_gather(
    platform_target: PlatformTarget, platform: Platform, caps: Capabilities, record_property: Any
) -> None:
    run_row(
        platform_target,
        platform,
        caps,
        record_property,
        "distributed.all_gather",
        ["all_gather_last", "all_gather_0"],
    )


@pytest.mark.capability("distributed.reduce_scatter")
def test_reduce_scatter(
    platform_target: PlatformTarget, platform: Platform, caps: Capabilities, record_property: Any
) -> None:
    steps = ["reduce_scatter_0", "reduce_scatter_1", "reduce_scatter_indivisible"]
    run_row(platform_target, platform, caps, record_property, "distributed.reduce_scatter", steps)


@pytest.mark.capability("distributed.broadcast")
def test_broadcast(
    platform_target: PlatformTarget, platform: Platform, caps: Capabilities, record_property: Any
) -> None:
    run_row(platform_target, platform, caps, record_property, "distributed.broadcast", ["broadcast", "close"])


@pytest.mark.capability("distributed.send_recv")
def test_send_recv(
    platform_target: PlatformTarget, platform: Platform, caps: Capabilities, record_property: Any
) -> None:
    run_row(platform_target, platform, caps, record_property, "distributed.send_recv", ["send_recv"])


@pytest.mark.capability("distributed.all_to_all")
def test_all_to_all(
    platform_target: PlatformTarget, platform: Platform, caps: Capabilities, record_property: Any
) -> None:
    steps = ["all_to_all", "all_to_all_indivisible"]
    run_row(platform_target, platform, caps, record_property, "distributed.all_to_all", steps)


@pytest.mark.capability("distributed.split")
def test_split(
    platform_target: PlatformTarget, platform: Platform, caps: Capabilities, record_property: Any
) -> None:
    """Sub-groups (tensor- within pipeline-parallel ranks): ranks renumbered in each group's order."""
    run_row(platform_target, platform, caps, record_property, "distributed.split",
            ["split_all_gather", "split_broadcast", "split_single"])  # fmt: skip


@pytest.mark.capability("distributed.world_size_1")
def test_world_size_1(platform: Platform, caps: Capabilities, device: Any, record_property: Any) -> None:
    capability = "distributed.world_size_1"
    if unclaimed(platform, caps, capability, record_property):
        return
    # one rank forms no process group, so this runs in the suite's own process
    comm = platform.make_communicator(1, 0, f"tcp://127.0.0.1:{free_port()}")
    assert (comm.world_size, comm.rank) == (1, 0), (
        f"{capability}: world_size/rank {comm.world_size}/{comm.rank}"
    )
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(5)).to(device)
    try:
        for name, out in (
            ("all_reduce", comm.all_reduce(x.clone())),
            ("all_gather", comm.all_gather(x.clone(), dim=-1)),
            ("reduce_scatter", comm.reduce_scatter(x.clone(), dim=0)),
            ("broadcast", comm.broadcast(x.clone(), src=0)),
            ("all_to_all", comm.all_to_all(x.clone())),
        ):
            mismatch = compare(out, x.to(torch.float64), EXACT, f"{capability} ({name})")
            if mismatch:
                pytest.fail(mismatch, pytrace=False)
        comm.barrier()
    finally:
        comm.close()
        comm.close()

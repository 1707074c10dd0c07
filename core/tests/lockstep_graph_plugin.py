"""A test-only platform, ``cpu-graphs``: the CPU platform claiming graph capture with the collectives inside,
so that a tensor-parallel engine on the CPU runs its decode steps through ``DecodeGraphs`` on every rank.

:class:`StaticReplayCapture` constrains the engine the way device graphs do: each bucket's step runs once
when it is recorded (its collectives included, so every rank must record the same buckets in the same
order), its inputs become static buffers that each replay copies into (a rank that padded a step another
way fails on the shape), and only recorded buckets replay. Every record and replay is appended to the file
named by ``ENGINE_TEST_GRAPH_LOG`` as ``<pid> <event> <bucket>``, so a test sees what each rank did.

``ENGINE_TEST_GRAPH_FAULT=<fault>:<driver pid>`` breaks every process but the driver (the workers):
``no-claim`` (its platform claims no collectives in graphs), ``capture`` (recording its second bucket
fails), ``replay`` (its second replay fails).

Spawned workers find it the way they find any plugin: an ``engine.plugins`` entry point of a dist-info
folder on ``sys.path`` (:func:`write_entry_point`), which they inherit from the test process.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.interfaces.graph_capture import GraphCapture
from engine.interfaces.platform import Capabilities
from engine.plugins.hookspecs import hookimpl
from engine_plugin_cpu.platform import CpuPlatform
from engine_test_utils import write_plugin_entry_point

ENGINE_PLUGIN_API = ">=2.0,<3"
DEVICE = "cpu-graphs"
LOG_ENV = "ENGINE_TEST_GRAPH_LOG"
FAULT_ENV = "ENGINE_TEST_GRAPH_FAULT"


def injected_fault() -> str | None:
    """The fault this process plays (None in the driver, or when none is asked for)."""
    kind, _, driver = os.environ.get(FAULT_ENV, "").partition(":")
    return kind if kind and driver and int(driver) != os.getpid() else None


def _record(event: str, bucket: int) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="ascii") as fh:
            fh.write(f"{os.getpid()} {event} {bucket}\n")


class StaticReplayCapture(GraphCapture):
    """Runs each bucket's step at capture and replays it over static input buffers (largest bucket first,
    as the GPU graphs record)."""

    def __init__(self) -> None:
        self._fn: Callable[..., Any] | None = None
        self._static: dict[int, tuple[torch.Tensor, ...]] = {}
        self._replays = 0

    def capture(
        self, fn: Callable[..., Any], batch_sizes: list[int], make_inputs: Callable[[int], tuple]
    ) -> None:
        self._fn = fn
        self._static.clear()
        for index, size in enumerate(sorted(set(batch_sizes), reverse=True)):
            if index == 1 and injected_fault() == "capture":
                raise RuntimeError(f"injected failure recording bucket {size}")
            inputs = tuple(make_inputs(size))
            fn(*inputs)  # what recording a device graph runs: the step's collectives included
            self._static[size] = inputs
            _record("capture", size)

    def run(self, batch_size: int, *inputs: Any) -> Any:
        if self._fn is None:
            raise RuntimeError("run() called before capture()")
        static = self._static.get(batch_size)
        if static is None:
            return self._fn(*inputs)
        self._replays += 1
        if self._replays == 2 and injected_fault() == "replay":
            raise RuntimeError(f"injected failure replaying bucket {batch_size}")
        for buffer, new in zip(static, inputs, strict=True):
            if buffer.shape != new.shape:  # copy_ would broadcast a short input silently
                raise ValueError(f"input {tuple(new.shape)} does not fit the recorded {tuple(buffer.shape)}")
            buffer.copy_(new)
        _record("replay", batch_size)
        return self._fn(*static)

    def captured_batch_sizes(self) -> list[int]:
        return sorted(self._static)


class LockstepGraphsPlatform(CpuPlatform):
    """The CPU platform with :class:`StaticReplayCapture` as its graphs, collectives claimed inside."""

    name = DEVICE
    aliases = ()
    priority = -1  # never chosen by --device auto

    def capabilities(self) -> Capabilities:
        return dataclasses.replace(
            super().capabilities(),
            graph_capture=True,
            graph_capture_collectives=injected_fault() != "no-claim",
        )

    def make_graph_capture(self) -> GraphCapture:
        return StaticReplayCapture()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [LockstepGraphsPlatform]


def write_entry_point(site: Path) -> None:
    """A dist-info folder in ``site`` whose ``engine.plugins`` entry point is this module."""
    write_plugin_entry_point(site, "engine_test_lockstep_graphs", DEVICE, __name__)


def read_log(path: Path) -> dict[int, list[tuple[str, int]]]:
    """What each process (by pid) recorded and replayed, in order."""
    events: dict[int, list[tuple[str, int]]] = {}
    for line in path.read_text(encoding="ascii").splitlines():
        pid, event, bucket = line.split()
        events.setdefault(int(pid), []).append((event, int(bucket)))
    return events

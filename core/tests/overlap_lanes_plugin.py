"""A test-only platform, ``reference-dbo``: the SDK's reference platform claiming step overlap, whose two
lanes are one queue audited as if they were two.

:class:`AuditedStepOverlap` runs every op at once, in the order it is queued, and watches each one (a
torch dispatch mode) as a GPU with two streams would order it: a tensor written on one lane may be read on
the other only after a :meth:`~engine.interfaces.step_overlap.StepOverlap.hand_over` to the reader that
came after the write. A read the streams would not order is recorded in ``violations``, so a core that
forgot a hand-over fails here although the serial result would be right.

Like ``lockstep_graph_plugin``, the engine finds it through an ``engine.plugins`` entry point of a
dist-info folder on ``sys.path`` (:func:`write_entry_point`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from engine.interfaces.platform import Capabilities
from engine.interfaces.step_overlap import Lane, StepOverlap
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_platform import ReferencePlatform
from engine_test_utils import write_plugin_entry_point

ENGINE_PLUGIN_API = ">=2.0,<3"
DEVICE = "reference-dbo"


class AuditedStepOverlap(StepOverlap):
    """One queue that checks every cross-lane read against the hand-overs two queues would need.

    Attributes:
        steps: overlapped steps begun.
        hand_overs: hand-overs made, by the lane that reads.
        violations: each read two streams would not have ordered after its write (op and lanes).
    """

    def __init__(self) -> None:
        self.steps = 0
        self.hand_overs = {Lane.COMPUTE: 0, Lane.ATTENTION: 0}
        self.violations: list[str] = []
        self.current: Lane | None = None
        #: ops queued so far (a write's sequence number)
        self._ops = 0
        #: for each lane, the other lane's ops it has waited for (its last hand-over's op count)
        self._waited = {Lane.COMPUTE: 0, Lane.ATTENTION: 0}
        self._written: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._mode: _LaneAudit | None = None

    def begin(self) -> None:
        if self.current is not None:
            raise AssertionError("begin() inside an overlapped step")
        self.steps += 1
        self.current = Lane.COMPUTE
        self._waited[Lane.ATTENTION] = self._ops  # the attention lane starts after the step's inputs
        self._mode = _LaneAudit(self)
        self._mode.__enter__()

    @contextmanager
    def _on(self, lane: Lane) -> Iterator[None]:
        if self.current is None:
            raise AssertionError("lane() outside an overlapped step")
        before, self.current = self.current, lane
        try:
            yield
        finally:
            self.current = before

    def lane(self, lane: Lane) -> AbstractContextManager[None]:
        return self._on(lane)

    def hand_over(self, to: Lane, tensors: Sequence[Any]) -> None:
        if self.current is None:
            raise AssertionError("hand_over() outside an overlapped step")
        self.hand_overs[to] += 1
        self._waited[to] = self._ops

    def end(self) -> None:
        if self.current is None or self._mode is None:
            raise AssertionError("end() without begin()")
        self._mode.__exit__(None, None, None)
        self._mode = None
        self.current = None
        self._waited = {Lane.COMPUTE: self._ops, Lane.ATTENTION: self._ops}

    def check_read(self, op: object, tensor: torch.Tensor) -> None:
        """Record a violation when ``tensor`` was written on the other lane after this lane last waited."""
        written = self._written.get(tensor)
        lane = self.current
        if written is None or lane is None:
            return
        writer, number = written
        if writer is not lane and number > self._waited[lane]:
            self.violations.append(f"{op} on the {lane.value} lane reads a result of the {writer.value} lane unawaited")

    def note_write(self, tensor: torch.Tensor) -> None:
        if self.current is not None:
            self._written[tensor] = (self.current, self._ops)

    def count_op(self) -> None:
        self._ops += 1


class _LaneAudit(TorchDispatchMode):
    """Checks each op's tensor inputs, then notes its outputs (in-place ones included) as written."""

    def __init__(self, audit: AuditedStepOverlap) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                self.audit.check_read(func, leaf)
        out = func(*args, **kwargs)
        self.audit.count_op()
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.audit.note_write(leaf)
        return out


class OverlapLanesPlatform(ReferencePlatform):
    """The reference platform with :class:`AuditedStepOverlap` as its lanes (the model holds them as
    ``step_overlap``)."""

    name = DEVICE
    priority = -1  # never chosen by --device auto

    def capabilities(self) -> Capabilities:
        # the reference attention is plain torch: the tiny models' head size of 32 runs too
        caps = super().capabilities()
        return dataclasses.replace(caps, step_overlap=True, head_sizes=(32, *caps.head_sizes))

    def make_step_overlap(self) -> StepOverlap:
        return AuditedStepOverlap()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [OverlapLanesPlatform]


def write_entry_point(site: Path) -> None:
    """A dist-info folder in ``site`` whose ``engine.plugins`` entry point is this module."""
    write_plugin_entry_point(site, "engine_test_overlap_lanes", DEVICE, __name__)

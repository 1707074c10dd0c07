"""The step-overlap contract: two lanes of device work, so that one nano-batch's attention runs while
another's matrix products run.

A large decode step spends its time in two kinds of kernels: the matrix products, bound by the device's
arithmetic, and the paged attention, bound by reading the KV cache. One after the other, each leaves the
other's resource idle. With ``enable_dbo`` the core cuts such a step into two nano-batches of sequences
and queues each layer's attention on an *attention lane* and everything else on the *compute lane*, so
that the attention of one nano-batch and the products of the other are in flight together
(:mod:`engine.models.layers.nano_batches`). A platform that can run two queues of work at once (GPU
streams) claims ``Capabilities.step_overlap`` and builds a :class:`StepOverlap`; the core never runs a
lane itself.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any


class Lane(enum.Enum):
    """The two queues of an overlapped step."""

    #: the queue the step was issued on (its products, norms and activations)
    COMPUTE = "compute"
    #: the queue the attention calls run on
    ATTENTION = "attention"


class StepOverlap(ABC):
    """Runs a step's device work on two lanes.

    The core calls, in this order: :meth:`begin` once; then, for each piece of work, :meth:`hand_over`
    to the lane that reads the other lane's results, and queues the work inside :meth:`lane` (the compute
    lane is the default outside it); :meth:`end` once. Inside a recorded graph the same calls are made
    while recording, so an implementation must fork from and join back to the recording queue.
    """

    @abstractmethod
    def begin(self) -> None:
        """Start an overlapped step on the current queue, which becomes the compute lane.

        The attention lane waits for everything queued so far (the step's inputs). Settings that divide
        the device between the lanes (for example products leaving some compute units to attention) apply
        from here until :meth:`end`.
        """

    @abstractmethod
    def lane(self, lane: Lane) -> AbstractContextManager[None]:
        """A context inside which device work is queued on ``lane``.

        Args:
            lane: the lane to queue on.

        Returns:
            The context manager.
        """

    @abstractmethod
    def hand_over(self, to: Lane, tensors: Sequence[Any]) -> None:
        """Make ``to`` wait for the work queued so far on the other lane, whose results in ``tensors`` it
        reads next.

        Args:
            to: the lane that reads the results.
            tensors: the results it reads; an implementation whose memory is recycled per queue marks them
                as in use by ``to`` until its work that reads them is done.
        """

    @abstractmethod
    def end(self) -> None:
        """Join the attention lane back into the compute lane and undo :meth:`begin`'s settings.

        After it, the compute lane (the step's queue) holds every result of the step.
        """


class SerialStepOverlap(StepOverlap):
    """Both lanes are the one queue: the work runs in the order it is queued. A platform that claims
    ``step_overlap`` without concurrent queues (an interpreter) uses it, and it is the reference every
    overlapped step must equal."""

    def begin(self) -> None:
        pass

    @contextmanager
    def _same_queue(self) -> Iterator[None]:
        yield

    def lane(self, lane: Lane) -> AbstractContextManager[None]:
        return self._same_queue()

    def hand_over(self, to: Lane, tensors: Sequence[Any]) -> None:
        pass

    def end(self) -> None:
        pass

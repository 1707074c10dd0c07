"""What the driver (rank 0) holds of the other ranks of one engine, whichever executor started them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from engine.config import EngineConfig
from engine.interfaces.communicator import Communicator
from engine.parallel.rank_graphs import GraphPlan
from engine.parallel.step_mirror import StepMessage


class RankWorkers(ABC):
    """Ranks ``1..size-1`` of one engine: started loading, then given a KV pool, then every step.

    Attributes:
        init_method: the rendezvous every rank's communicator joins (the driver's too).
        communicators: the driver's own communicators, closed with the workers (a group left open would
            be joined again by the next engine of this process, whose peers are gone).
    """

    init_method: str
    communicators: list[Communicator]

    @abstractmethod
    def start_pools(self, num_blocks: int) -> None:
        """Wait until every rank has loaded its shard, then have each allocate a KV pool of ``num_blocks``.

        Raises:
            engine.parallel.mp_workers.WorkerFailed: a rank failed to load or allocate (its reason), or exited.
        """

    @abstractmethod
    def capture_graphs(self, plan: GraphPlan, capture_here: Callable[[], object]) -> None:
        """Record decode graphs on every rank in lockstep: each rank builds its own for ``plan`` and checks
        it before anyone records; then ``capture_here`` records the driver's while the ranks record theirs
        (the same buckets in the same order, so that the collectives inside pair up).

        Args:
            plan: the driver's buckets and context limit.
            capture_here: records the driver's graphs.

        Raises:
            engine.parallel.mp_workers.WorkerFailed: a rank refused the plan (its reason: it runs eagerly,
                or would record other buckets) or failed or exited while recording.
        """

    def collectively(self, run: Callable[[], object]) -> None:
        """Run the driver's side of work the other ranks do at the same time (``run``): its collectives
        fail when a rank stops, which becomes :class:`WorkerFailed` with that rank's reason.

        Raises:
            engine.parallel.mp_workers.WorkerFailed: a rank is gone.
        """
        from engine.parallel.mp_workers import WorkerFailed

        try:
            run()
        except RuntimeError as exc:
            failure = self.failure()
            if failure is None:
                raise
            raise WorkerFailed(f"{failure}; the engine cannot go on") from exc

    @abstractmethod
    def mirror(self, message: StepMessage) -> None:
        """Send a step to every rank (before the driver runs it; all then enter its collectives together).

        Raises:
            engine.parallel.mp_workers.WorkerFailed: a rank is gone.
        """

    @abstractmethod
    def failure(self, wait_s: float = 2.0) -> str | None:
        """Which rank is gone and how, or None while all run (a rank killed mid-collective shows up as the
        driver's collective failing first; its exit may take a moment to be seen).

        Args:
            wait_s: how long to wait for an exit to show.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop every rank and wait for it (killed if it does not stop); safe to call twice."""


def start_rank_workers(config: EngineConfig, size: int, device_resource: str | None) -> RankWorkers:
    """Start ranks ``1..size-1`` with the configured executor (``mp`` unless ``ray`` is asked for).

    Args:
        config: the engine configuration (every rank builds its shard from it).
        size: the ranks of the engine, the driver's included.
        device_resource: the Ray resource one device of the platform is (``Platform.ray_device_resource``).
    """
    if config.parallel.distributed_executor_backend == "ray":
        from engine.parallel.ray_workers import RayWorkers

        return RayWorkers.start(config, size, device_resource)
    from engine.parallel.mp_workers import ParallelWorkers

    return ParallelWorkers.start(config, size)

"""The Ray executor (``distributed_executor_backend="ray"``): ranks ``1..size-1`` as Ray actors, one per
bundle of a placement group, on whichever hosts of the Ray cluster have the resources.

The driver (rank 0) runs in this process, as with the ``mp`` executor; each actor builds the same
:class:`~engine.parallel.worker.RankShard` a spawned process would, and the steps reach it as actor
calls, which Ray runs in the order they were sent. The ranks rendezvous at this host's address as Ray
sees it, so that ranks on other hosts reach it too. ``ray.init()`` joins the cluster this host belongs
to (``ray start`` on it, or ``RAY_ADDRESS``), and starts a local one otherwise.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.interfaces.communicator import Communicator
from engine.parallel.mp_workers import LOAD_TIMEOUT_S, WorkerFailed
from engine.parallel.rank_graphs import GraphPlan
from engine.parallel.rank_workers import RankWorkers
from engine.parallel.step_mirror import StepMessage
from engine.parallel.worker import RankShard, first_line
from engine.ports import free_port

logger = logging.getLogger(__name__)

#: seconds a rank has to answer a liveness check or to close
_ANSWER_S = 10.0
#: seconds a rank's actor lives on after a call run with the driver's collectives raised: time for Ray
#: to hand the error back, which failure() then reports
_EXIT_AFTER_FAILURE_S = 0.5


class RankActor:
    """The body of one rank's Ray actor (``ray.remote`` wraps it when the executor starts)."""

    def __init__(self) -> None:
        self.shard: RankShard | None = None

    def load(self, config_json: str, rank: int, size: int, init_method: str) -> None:
        self.shard = RankShard(config_json, rank, size, init_method, isolated_device=True)

    def allocate(self, num_blocks: int) -> None:
        assert self.shard is not None
        self.shard.allocate(num_blocks)

    def plan_graphs(self, plan: GraphPlan) -> None:
        assert self.shard is not None
        self.shard.plan_graphs(plan)

    def capture_graphs(self) -> None:
        assert self.shard is not None
        self._in_lockstep(self.shard.capture_graphs)

    def step(self, message: StepMessage) -> None:
        shard = self.shard
        assert shard is not None
        self._in_lockstep(lambda: shard.run_step(message))

    @staticmethod
    def _in_lockstep(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException:
            # The rank is out of step for good, and the driver may be waiting in a collective for it. A
            # spawned process exits here, which closes its group's connections and fails the driver's
            # collective; an actor would live on with them open (a gloo group outlives
            # destroy_process_group while torch still refers to it), so it ends its process once Ray
            # has the error.
            threading.Timer(_EXIT_AFTER_FAILURE_S, os._exit, args=(1,)).start()
            raise

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        if self.shard is not None:
            self.shard.close()


class RayWorkers(RankWorkers):
    """Ranks ``1..size-1`` as Ray actors in a placement group.

    Args:
        ray: the imported ``ray`` module.
        actors: the actors' handles, rank 1 first.
        placement_group: the group their bundles belong to.
        loading: each actor's pending ``load`` call.
        init_method: the rendezvous every rank's communicator joins.
        owns_ray: whether this executor started Ray (it then shuts it down on close).
    """

    def __init__(
        self, ray: Any, actors: list[Any], placement_group: Any, loading: list[Any], init_method: str, owns_ray: bool
    ) -> None:
        self.ray = ray
        self.actors = actors
        self.placement_group = placement_group
        self.init_method = init_method
        self.communicators: list[Communicator] = []
        self._loading = loading
        self._owns_ray = owns_ray
        self._closed = False
        #: each rank's latest call that runs collectives with the driver, not waited for: a rank that
        #: fails in it leaves the group, and failure() then finds its reason here
        self._in_lockstep: list[Any] = []

    @classmethod
    def start(cls, config: EngineConfig, size: int, device_resource: str | None) -> RayWorkers:
        """Reserve a bundle per rank (a CPU, plus one ``device_resource`` when the platform names one),
        start an actor in each and have it start loading its shard.

        Raises:
            engine.engine_setup.EngineConfigError: Ray is not installed, or the cluster cannot hold the
                bundles within the load timeout.
        """
        from engine.engine_setup import EngineConfigError

        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise EngineConfigError(
                "distributed_executor_backend 'ray' needs Ray: pip install 'ray>=2.9'"
            ) from None
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(log_to_driver=False, include_dashboard=False)
        bundle = {"CPU": 1.0, **({device_resource: 1.0} if device_resource else {})}
        group = placement_group([dict(bundle) for _ in range(size - 1)], strategy="PACK")
        try:
            ray.get(group.ready(), timeout=LOAD_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise EngineConfigError(
                f"the Ray cluster cannot reserve {size - 1} bundles of {bundle} for the other ranks"
            ) from None
        init_method = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
        actor_class = ray.remote(RankActor)
        actors, loading = [], []
        payload = config.to_process_json()
        for rank in range(1, size):
            actor = actor_class.options(
                num_cpus=bundle["CPU"],
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank - 1),
                name=None,
            ).remote()
            actors.append(actor)
            loading.append(actor.load.remote(payload, rank, size, init_method))
        logger.info("started %d Ray actors for ranks 1..%d (rendezvous %s)", size - 1, size - 1, init_method)
        return cls(ray, actors, group, loading, init_method, owns_ray)

    def _wait(self, refs: list[Any], timeout: float) -> None:
        for rank, ref in enumerate(refs, start=1):
            try:
                self.ray.get(ref, timeout=timeout)
            except self.ray.exceptions.GetTimeoutError:
                raise WorkerFailed(f"rank {rank} did not answer within {timeout:.0f} s") from None
            except self.ray.exceptions.RayError as exc:
                raise WorkerFailed(f"rank {rank}: {_cause(exc)}") from None

    def start_pools(self, num_blocks: int) -> None:
        self._wait(self._loading, LOAD_TIMEOUT_S)
        self._wait([actor.allocate.remote(num_blocks) for actor in self.actors], LOAD_TIMEOUT_S)

    def capture_graphs(self, plan: GraphPlan, capture_here: Callable[[], object]) -> None:
        # the plans are checked (and answered) before anyone records: a refusal enters no collective
        self._wait([actor.plan_graphs.remote(plan) for actor in self.actors], LOAD_TIMEOUT_S)
        self._in_lockstep = [actor.capture_graphs.remote() for actor in self.actors]
        self.collectively(capture_here)
        self._wait(self._in_lockstep, LOAD_TIMEOUT_S)

    def mirror(self, message: StepMessage) -> None:
        # not waited for: a rank that fails makes the driver's next collective fail, then failure() says why
        self._in_lockstep = [actor.step.remote(message) for actor in self.actors]

    def failure(self, wait_s: float = 2.0) -> str | None:
        # a rank whose call raised (and so left the group) is still alive: that call's error says why
        pending = self._in_lockstep
        timeout = max(wait_s, 0.1)
        done = self.ray.wait(pending, num_returns=len(pending), timeout=timeout)[0] if pending else []
        for rank, ref in enumerate(pending, start=1):
            if ref in done:
                try:
                    self.ray.get(ref, timeout=0)
                except self.ray.exceptions.RayTaskError as exc:
                    return f"rank {rank}: {_cause(exc)}"
                except self.ray.exceptions.RayError:
                    continue  # the actor itself is gone: the liveness check below says so
        for rank, actor in enumerate(self.actors, start=1):
            try:
                self.ray.get(actor.ping.remote(), timeout=max(wait_s, 0.1))
            except self.ray.exceptions.GetTimeoutError:
                continue  # busy (still in a step): not known to be gone
            except self.ray.exceptions.RayError as exc:
                return f"rank {rank} (a Ray actor) is gone: {_cause(exc)}"
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                self.ray.get(actor.close.remote(), timeout=_ANSWER_S)
            except self.ray.exceptions.RayError:
                pass  # gone or stuck: killed below either way
            self.ray.kill(actor)
        remove_placement_group(self.placement_group)
        for comm in self.communicators:
            comm.close()
        if self._owns_ray:
            self.ray.shutdown()


def _cause(exc: BaseException) -> str:
    """The first line of what went wrong inside an actor (Ray wraps it in its own error)."""
    inner = getattr(exc, "cause", None)
    return first_line(inner) if isinstance(inner, BaseException) else first_line(exc)

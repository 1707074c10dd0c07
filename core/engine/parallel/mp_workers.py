"""The driver's side of tensor parallelism with local processes (``distributed_executor_backend="mp"``).

Ranks ``1..size-1`` run :func:`engine.parallel.worker.run_worker` in processes started with ``spawn``;
the driver (rank 0) holds the scheduler and the sampler and sends every step to them over a pipe before
running it itself, so that all ranks enter each collective together. A worker that fails says why on
its pipe; the driver raises that as an error. A worker whose driver is gone sees its pipe close and
exits, so no rank outlives the engine.
"""

from __future__ import annotations

import logging
import multiprocessing
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from engine.config import EngineConfig
from engine.errors import FatalEngineError
from engine.interfaces.communicator import Communicator
from engine.parallel.rank_graphs import GraphPlan
from engine.parallel.rank_workers import RankWorkers
from engine.parallel.step_mirror import StepMessage
from engine.ports import free_port

logger = logging.getLogger(__name__)

#: seconds the driver waits for a worker to load its shard (a large model's slice takes minutes)
LOAD_TIMEOUT_S = 1800.0


class WorkerFailed(FatalEngineError):
    """A parallel rank failed or exited; the message says which and why."""


class ParallelWorkers(RankWorkers):
    """The processes of ranks ``1..size-1`` and the driver's pipes to them (the ``mp`` executor).

    Args:
        processes: the worker processes, rank 1 first.
        pipes: the driver's end of each one's pipe.
        init_method: the rendezvous every rank's communicator joins.
    """

    def __init__(self, processes: list[Any], pipes: list[Connection], init_method: str) -> None:
        self.processes = processes
        self.pipes = pipes
        self.init_method = init_method
        #: the driver's own communicators, closed with the workers (a group left open would be joined
        #: again by the next engine of this process, whose peers are gone)
        self.communicators: list[Communicator] = []
        # an engine dropped without close() still takes its workers down
        self._finalizer = weakref.finalize(self, stop_processes, processes, pipes, self.communicators)

    @classmethod
    def start(cls, config: EngineConfig, size: int) -> ParallelWorkers:
        """Start ranks ``1..size-1``; each loads its shard once the driver's communicator joins them."""
        from engine.parallel.worker import run_worker

        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context("spawn")
        processes, pipes = [], []
        payload = config.to_process_json()
        for rank in range(1, size):
            parent, child = context.Pipe()
            process = context.Process(
                target=run_worker, args=(payload, rank, size, init_method, child), name=f"engine-tp-rank{rank}"
            )
            process.start()
            child.close()
            processes.append(process)
            pipes.append(parent)
        logger.info("started %d tensor-parallel worker processes (rendezvous %s)", size - 1, init_method)
        return cls(processes, pipes, init_method)

    def _expect(self, kind: str, timeout: float) -> None:
        for rank, pipe in enumerate(self.pipes, start=1):
            if not pipe.poll(timeout):
                raise WorkerFailed(f"rank {rank} did not answer within {timeout:.0f} s")
            try:
                got, detail = pipe.recv()
            except EOFError:
                raise WorkerFailed(f"rank {rank} exited") from None
            if got == "error":
                raise WorkerFailed(detail)
            if got != kind:
                raise WorkerFailed(f"rank {rank} said {got!r}, expected {kind!r}")

    def start_pools(self, num_blocks: int) -> None:
        """Have every worker finish loading and allocate a KV pool of ``num_blocks`` (as rank 0's).

        Raises:
            WorkerFailed: a worker failed to load or allocate (its reason), or exited.
        """
        self._expect("loaded", LOAD_TIMEOUT_S)
        for pipe in self.pipes:
            pipe.send(("pool", num_blocks))
        self._expect("ready", LOAD_TIMEOUT_S)

    def capture_graphs(self, plan: GraphPlan, capture_here: Callable[[], object]) -> None:
        """Have every worker check ``plan`` (all answer before anyone records), then record the driver's
        graphs while they record theirs.

        Raises:
            WorkerFailed: a worker refused the plan, or failed or exited while recording (its reason).
        """
        self._send_all("plan", plan)
        self._expect("planned", LOAD_TIMEOUT_S)
        self._send_all("capture", None)
        self.collectively(capture_here)
        self._expect("captured", LOAD_TIMEOUT_S)

    def mirror(self, message: StepMessage) -> None:
        """Send a step to every worker (before the driver runs it).

        Raises:
            WorkerFailed: a worker's pipe is closed (it exited).
        """
        self._send_all("step", message)

    def _send_all(self, kind: str, payload: object) -> None:
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send((kind, payload))
            except (BrokenPipeError, EOFError, OSError):
                raise WorkerFailed(f"rank {rank} exited") from None

    def failure(self, wait_s: float = 2.0) -> str | None:
        """Which worker has exited and how, or None while all run (a worker killed during a collective
        shows up as the driver's collective failing; its exit may take a moment to be seen).

        Args:
            wait_s: how long to wait for an exit to show.
        """
        for rank, process in enumerate(self.processes, start=1):
            if process.is_alive():
                process.join(wait_s / len(self.processes))
            if process.exitcode is not None:
                code = process.exitcode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                reason = _last_words(self.pipes[rank - 1])
                return f"rank {rank} {how}" + (f" ({reason})" if reason else "")
        return None

    def close(self) -> None:
        """Stop every worker and wait for it (killed if it does not stop); safe to call twice."""
        self._finalizer()


def exit_reason(process: Any, who: str, wait_s: float = 2.0) -> str:
    """Why the engine cannot go on without ``who``, a process whose pipe failed: how it ended (waiting up to
    ``wait_s`` for that to show), or that it still runs with its pipe closed."""
    process.join(wait_s)
    code = process.exitcode
    how = (
        "is still running but closed its pipe" if code is None
        else f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    )  # fmt: skip
    return f"{who} {how}; the engine cannot go on"


def _last_words(pipe: Connection) -> str | None:
    """The reason an exited worker sent before it stopped (``("error", reason)``), if it sent one."""
    try:
        while pipe.poll(0):
            kind, detail = pipe.recv()
            if kind == "error":
                return str(detail)
    except (EOFError, OSError):
        return None  # the pipe closed with nothing (more) said
    return None


def stop_processes(
    processes: list[Any], pipes: list[Connection], communicators: list[Communicator], timeout: float = 10.0
) -> None:
    for pipe in pipes:
        try:
            pipe.send(("stop", None))
        except (BrokenPipeError, EOFError, OSError):
            pass  # already gone: nothing to tell it
        pipe.close()
    for process in processes:
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join(timeout)
    for comm in communicators:
        comm.close()

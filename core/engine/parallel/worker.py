"""A parallel rank's work: load this rank's shard (tensor slices or pipeline stage), allocate its KV pool,
record its decode graphs when the driver does, then run every step the driver sends. :class:`RankShard`
is that work; :func:`run_worker` drives it from a pipe in a process of its own (the ``mp`` executor),
:mod:`engine.parallel.ray_workers` from a Ray actor."""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import torch

from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs
from engine.interfaces.block_cache import apply_block_moves
from engine.parallel.micro_batches import forward_logits
from engine.parallel.rank_graphs import (
    GraphPlan,
    LockstepError,
    build_decode_graphs,
    check_plan,
    replay_bucket,
)
from engine.parallel.step_mirror import StepMessage, moved

logger = logging.getLogger(__name__)


class RankShard:
    """Rank ``rank`` of ``size``: joins the group at ``init_method`` and loads its shard when built.

    ``isolated_device``: the process sees only the device reserved for it (a Ray actor given one), which
    is then its device 0, whatever its rank.

    Raises:
        EngineConfigError, ModelLoadError, RuntimeError: the shard cannot be built (the reason says why).
    """

    def __init__(self, config_json: str, rank: int, size: int, init_method: str, isolated_device: bool = False) -> None:
        from engine.engine_setup import build_model, rank_parallelism, resolve_model
        from engine.plugins.manager import PluginManager
        from engine.plugins.selection import select_platform

        self.comm = None
        self.rank = rank
        config = EngineConfig.model_validate_json(config_json)
        manager = PluginManager()
        self.platform = select_platform(config.device, manager)
        config, model_path, self.model_config, model_class, registry = resolve_model(config, self.platform, manager)
        self.config = config
        isolated = isolated_device and self.platform.ray_device_resource is not None
        local_rank = 0 if isolated else config.parallel.first_local_device + rank
        self.platform.use_device(local_rank)
        self.comm = self.platform.make_communicator(size, rank, init_method, local_rank=local_rank)
        try:
            tp, pp = rank_parallelism(config, self.model_config, rank, self.comm)
            self.model, self.attention, _ = build_model(
                config, self.platform, registry, model_path, self.model_config, model_class, tp, pp
            )
        except BaseException:
            self.close()
            raise
        self.device = self.platform.torch_device()
        self.block_cache: Any = None
        self.caches: list[Any] = []
        self.kv_layout: Any = None
        #: this rank's decode graphs, once the driver sends its plan (None: every step runs eagerly)
        self.graphs: DecodeGraphs | None = None

    def allocate(self, num_blocks: int) -> None:
        """Allocate a KV pool of ``num_blocks`` blocks (the driver's count) for this rank's layers and heads."""
        from engine.engine_setup import kv_group_layout
        from engine.kv_pool import make_kv_pool

        layout = self.kv_layout = kv_group_layout(self.model)
        cache = self.config.cache.model_copy(update={"num_blocks_override": num_blocks})
        sized = self.config.model_copy(update={"cache": cache})
        self.block_cache, _ = make_kv_pool(sized, self.platform, self.model_config, self.attention, layout, self.model)
        kv = self.block_cache.kv_caches
        self.caches = kv if layout is None else layout.layer_caches(kv)

    def plan_graphs(self, plan: GraphPlan) -> None:
        """Build this rank's decode graphs over its shard and pool for the driver's ``plan`` (after
        :meth:`allocate`); nothing is recorded yet, so a refusal here enters no collective.

        Raises:
            LockstepError: this rank runs eagerly (its platform does not claim
                ``graph_capture_collectives``) or would record other buckets than the driver.
        """
        caps = self.platform.capabilities()
        if self.config.enforce_eager or not caps.graph_capture:
            raise LockstepError(
                f"rank {self.rank} runs eagerly ({self.platform.name} records no collectives in its graphs: "
                "Capabilities.graph_capture_collectives), yet the driver records decode graphs"
            )
        graphs = build_decode_graphs(
            self.config, self.platform, self.model_config, self.model, self.caches, self.device,
            plan.max_model_len, self.kv_layout,
        )  # fmt: skip
        check_plan(graphs, plan, self.rank)
        self.graphs = graphs

    def capture_graphs(self) -> None:
        """Record the planned graphs, together with the driver and every other rank (their collectives pair).

        Raises:
            LockstepError: :meth:`plan_graphs` did not run.
        """
        if self.graphs is None:
            raise LockstepError(f"rank {self.rank} was asked to record decode graphs without a plan")
        self.graphs.capture()

    @torch.inference_mode()
    def run_step(self, message: StepMessage) -> None:
        """The driver's step on this rank's shard: the same block moves, forward and (gathered) logits,
        through the same decode graph's bucket when the driver replays one.

        Raises:
            LockstepError: the driver replays a bucket this rank cannot.
        """
        apply_block_moves(self.block_cache, message.swap_out, message.copies, message.swap_in)
        device = self.device
        count = self.config.parallel.micro_batches
        if count > 1:  # the driver cuts the step alike (see engine.parallel.micro_batches)
            indices = moved(message.logits_indices, device) if message.logits_indices is not None else None
            forward_logits(
                self.model, self.caches, moved(message.input_ids, device), moved(message.positions, device),
                moved(message.metadata, device), indices, count,
            )  # fmt: skip
            return
        input_ids, positions = moved(message.input_ids, device), moved(message.positions, device)
        metadata = moved(message.metadata, device)
        bucket = message.graph_bucket
        if bucket is not None:
            hidden = replay_bucket(self.graphs, bucket, input_ids, positions, metadata, self.rank)
        else:
            hidden = self.model.forward(input_ids, positions, self.caches, metadata)
        if message.logits_indices is not None:
            self.model.compute_logits(hidden.index_select(0, moved(message.logits_indices, device)))

    def close(self) -> None:
        """Leave the group (a group left open would be joined again by the next engine of this process)."""
        if self.comm is not None:
            self.comm.close()
            self.comm = None


def first_line(exc: BaseException) -> str:
    """An exception's first line (its type's name when it has no message)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def exit_with_failure(pipe: Connection, who: str, exc: BaseException) -> NoReturn:
    """Tell the driver why this process stops (``("error", "<who>: <reason>")``), then exit with status 1."""
    reason = first_line(exc)
    try:
        pipe.send(("error", f"{who}: {reason}"))
    except (BrokenPipeError, OSError):
        logger.error("%s failed (driver gone): %s", who, reason)
    raise SystemExit(1) from None


def run_worker(config_json: str, rank: int, size: int, init_method: str, pipe: Connection) -> None:
    """The process entry of rank ``rank``: answers ``loaded``, then ``ready`` once its pool is allocated
    (``("pool", num_blocks)``), then runs ``("step", StepMessage)`` messages until ``("stop", None)`` or
    until the driver's end of the pipe closes. ``("plan", GraphPlan)`` is answered ``planned`` once this
    rank's decode graphs are built and checked, ``("capture", None)`` ``captured`` once they are recorded
    (together with the driver's and every other rank's).
    A failure is sent as ``("error", reason)`` before exiting."""
    shard = None
    try:
        shard = RankShard(config_json, rank, size, init_method)
        pipe.send(("loaded", None))
        kind, num_blocks = pipe.recv()
        if kind != "pool":
            return
        shard.allocate(num_blocks)
        pipe.send(("ready", None))
        while True:
            kind, message = pipe.recv()
            if kind == "step":
                shard.run_step(message)
            elif kind == "plan":
                shard.plan_graphs(message)
                pipe.send(("planned", None))
            elif kind == "capture":
                shard.capture_graphs()
                pipe.send(("captured", None))
            else:
                return
    except EOFError:
        return  # the driver is gone: so is this rank's reason to run
    except BaseException as exc:
        exit_with_failure(pipe, f"rank {rank}", exc)
    finally:
        if shard is not None:
            shard.close()

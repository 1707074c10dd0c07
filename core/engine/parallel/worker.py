"""A parallel rank's process: load this rank's shard (tensor slices or pipeline stage), then run every
step the driver sends."""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.config import EngineConfig
from engine.parallel.step_mirror import StepMessage, moved

logger = logging.getLogger(__name__)


def run_worker(config_json: str, rank: int, size: int, init_method: str, pipe: Connection) -> None:
    """The process entry of rank ``rank``: answers ``loaded``, then ``ready`` once its pool is allocated
    (``("pool", num_blocks)``), then runs ``("step", StepMessage)`` messages until ``("stop", None)`` or
    until the driver's end of the pipe closes. A failure is sent as ``("error", reason)`` before exiting."""
    from engine.engine_setup import (
        build_model,
        kv_group_layout,
        make_kv_pool,
        rank_parallelism,
        resolve_model,
    )
    from engine.plugins.manager import PluginManager
    from engine.plugins.selection import select_platform

    comm = None
    try:
        config = EngineConfig.model_validate_json(config_json)
        manager = PluginManager()
        platform = select_platform(config.device, manager)
        config, model_path, model_config, model_class, registry = resolve_model(config, platform, manager)
        local_rank = config.parallel.first_local_device + rank
        platform.use_device(local_rank)
        comm = platform.make_communicator(size, rank, init_method, local_rank=local_rank)
        tp, pp = rank_parallelism(config, model_config, rank, comm)
        model, attention, _ = build_model(config, platform, registry, model_path, model_config, model_class, tp, pp)
        pipe.send(("loaded", None))
        kind, num_blocks = pipe.recv()
        if kind != "pool":
            return
        layout = kv_group_layout(model)
        sized = config.model_copy(update={"cache": config.cache.model_copy(update={"num_blocks_override": num_blocks})})
        block_cache, _ = make_kv_pool(sized, platform, model_config, attention, layout, model)
        caches = block_cache.kv_caches if layout is None else layout.layer_caches(block_cache.kv_caches)
        pipe.send(("ready", None))
        device = platform.torch_device()
        while True:
            kind, message = pipe.recv()
            if kind != "step":
                return
            _run_step(model, block_cache, caches, message, device)
    except EOFError:
        return  # the driver is gone: so is this rank's reason to run
    except BaseException as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        try:
            pipe.send(("error", f"rank {rank}: {reason}"))
        except (BrokenPipeError, OSError):
            logger.error("tensor-parallel rank %d failed (driver gone): %s", rank, reason)
        raise SystemExit(1) from None
    finally:
        if comm is not None:
            comm.close()


@torch.inference_mode()
def _run_step(model: Any, block_cache: Any, caches: list[Any], message: StepMessage, device: torch.device) -> None:
    """The driver's step on this rank's shard: the same block moves, forward and (gathered) logits."""
    if message.swap_out:
        block_cache.swap_out(message.swap_out)
    if message.copies:
        block_cache.copy_blocks(message.copies)
    if message.swap_in:
        block_cache.swap_in(message.swap_in)
    hidden = model.forward(
        moved(message.input_ids, device), moved(message.positions, device), caches, moved(message.metadata, device)
    )
    if message.logits_indices is not None:
        model.compute_logits(hidden.index_select(0, moved(message.logits_indices, device)))

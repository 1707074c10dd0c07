"""Decode graphs on every tensor-parallel rank, recorded and replayed in lockstep.

A rank's decode graph holds its share of the step's collectives (the all-reduce after each row-parallel
projection, the embedding's), so a graph replayed on one rank only completes when every other rank
replays a graph holding the same collectives, on tensors of the same shape. Two rules keep them paired:

- every rank records the same buckets in the same order: the driver sends its :class:`GraphPlan` and
  each rank checks its own graphs against it before it records anything (:func:`check_plan`);
- a step the driver replays through a bucket's graph replays through that bucket on every rank: the
  bucket travels in the step's :class:`~engine.parallel.step_mirror.StepMessage`, and a rank whose own
  graphs would run the step another way stops (:func:`replay_bucket`) rather than enter other
  collectives than its peers.

A mismatch is a :class:`LockstepError`. The rank that raises it stops (its process ends, which closes its
connections), so the driver's collective fails at once instead of waiting for it, and the executor
reports the rank's reason as :class:`~engine.parallel.mp_workers.WorkerFailed`.
Pipeline stages stay eager (see :func:`engine.engine_setup.resolve_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.decode_graphs import DecodeGraphs

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.interfaces.attention import AttentionMetadata
    from engine.interfaces.platform import Platform
    from engine.kv_groups import GroupedAttentionMetadata, KVGroupLayout
    from engine.models.config import ModelConfig


class LockstepError(RuntimeError):
    """A rank cannot record or replay the decode graphs its driver does (its collectives would not pair)."""


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """What every rank records, sent by the driver before anyone records.

    Attributes:
        buckets: the batch-size buckets, in the driver's order.
        max_model_len: the context limit the driver's pool allows (fixes the block-table width, hence
            the graphs' input shapes).
    """

    buckets: tuple[int, ...]
    max_model_len: int

    @classmethod
    def of(cls, graphs: DecodeGraphs) -> GraphPlan:
        """The plan ``graphs`` records."""
        return cls(tuple(graphs.buckets), graphs.max_model_len)


def build_decode_graphs(
    config: EngineConfig,
    platform: Platform,
    model_config: ModelConfig,
    model: Any,
    kv_caches: list[Any],
    device: torch.device,
    max_model_len: int,
    kv_layout: KVGroupLayout | None = None,
    lora_slots: int = 0,
) -> DecodeGraphs:
    """The decode graphs of one rank's model over its own KV caches (not recorded yet); every rank builds
    them from the same configuration, so that their buckets agree.

    Args:
        config: the engine configuration (``max_num_seqs`` sets the largest bucket, the block size).
        platform: records the graphs (:meth:`Platform.make_graph_capture`).
        model_config: the model's settings (its attention window).
        model: this rank's model (its shard).
        kv_caches: this rank's per-layer caches.
        device: where the graphs' static inputs live.
        max_model_len: the driver's context limit.
        kv_layout: the model's KV groups, if any.
        lora_slots: the adapter slots (0: LoRA off).

    Returns:
        The graphs; :meth:`DecodeGraphs.capture` records them.
    """
    return DecodeGraphs(
        model, kv_caches, platform.make_graph_capture(), config.scheduler.max_num_seqs, max_model_len,
        config.cache.block_size, device, model_config.sliding_window, kv_layout, lora_slots=lora_slots,
    )  # fmt: skip


def check_plan(graphs: DecodeGraphs, plan: GraphPlan, rank: int) -> None:
    """Check that ``graphs`` records what the driver's ``plan`` says, before either records anything.

    Raises:
        LockstepError: the buckets or the context limit differ (a rank of another configuration or
            version would enter other collectives than its peers).
    """
    own = GraphPlan.of(graphs)
    if own != plan:
        raise LockstepError(
            f"rank {rank} would record decode graphs for buckets {list(own.buckets)} up to context "
            f"{own.max_model_len}, the driver for {list(plan.buckets)} up to {plan.max_model_len}"
        )


def replay_bucket(
    graphs: DecodeGraphs | None,
    bucket: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata | GroupedAttentionMetadata,
    rank: int,
) -> torch.Tensor:
    """This rank's hidden states of a step the driver replays through ``bucket``'s graph, padded by the
    same :class:`DecodeGraphs` code as the driver's.

    Raises:
        LockstepError: this rank has no graphs, or its graphs would run the step eagerly or through
            another bucket.
    """
    if graphs is None:
        raise LockstepError(f"rank {rank} recorded no decode graphs, yet the driver replays bucket {bucket}")
    own = graphs.bucket_for(input_ids, metadata)
    if own != bucket:
        theirs = "eagerly" if own is None else f"through bucket {own}"
        raise LockstepError(f"rank {rank} would run the step {theirs}, the driver replays bucket {bucket}")
    hidden = graphs.run(input_ids, positions, metadata, bucket=bucket)
    assert hidden is not None  # a bucket is given: run replays it
    return hidden

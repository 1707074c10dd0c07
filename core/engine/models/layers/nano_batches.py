"""Dual-batch overlap: a large decode step as two nano-batches whose attention and products run at once.

In a decode step of hundreds of sequences the matrix products are bound by arithmetic and the paged
attention by reading the KV cache (at 1,000 sequences of 640 tokens, a Llama-3-8B step reads about 80 GB
of keys and values besides its 15 GB of weights). Run one after the other, each leaves the other's
resource idle. Here the step's sequences are cut in two halves, A and B, and each layer's work is queued
on the platform's two lanes (:class:`~engine.interfaces.step_overlap.StepOverlap`) in this order::

    compute lane:   ...  finish(A, l-1) + begin(A, l) | finish(B, l-1) + begin(B, l) | finish(A, l) ...
    attention lane: ...  attend(B, l-1)               | attend(A, l)                 | attend(B, l) ...

where ``begin`` is a layer's input norm and q/k/v projection, ``attend`` the backend's attention call
(which writes the new keys and values) and ``finish`` the output projection and the MLP. Once the first
layer is under way, each half's attention runs while the other half's products do. The halves share no
state, so the result is the whole step's, row for row (the products see half the rows each).

Pre-norm decoders overlap, with or without KV groups (each group's tables cut alike); latent attention,
post-norms fused across layers and models split over ranks are refused at start-up. A step with adapter
rows, a prompt, layer inputs kept for a draft head, or fewer sequences than the threshold runs whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import EngineConfigError
from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.step_overlap import Lane, StepOverlap
from engine.kv_groups import GroupedAttentionMetadata
from engine.parallel.micro_batches import slice_metadata

if TYPE_CHECKING:
    from engine.interfaces.platform import Platform
    from engine.models.layers.decoder import DenseDecoder

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _NanoBatch:
    """One half of the step as it moves through the layers."""

    layer_metadata: list[AttentionMetadata]
    tables: list[tuple[torch.Tensor, torch.Tensor]]
    hidden: torch.Tensor
    residual: torch.Tensor | None = None
    #: the attention block's input (the norm's output), read again by a parallel-branch MLP
    x: Any = None
    #: the current layer's attention result, queued on the attention lane (None before the first layer)
    attn: torch.Tensor | None = None


def overlap_problems(model: DenseDecoder) -> list[str]:
    """Why ``model`` cannot run its steps as two overlapped nano-batches (empty: it can).

    Args:
        model: the loaded model.

    Returns:
        Every reason, each a short phrase.
    """
    problems = []
    if model.tp is not None or model.pp is not None:
        problems.append("it is split over ranks")
    if any(layer.mla is not None for layer in model.layers):
        problems.append("its latent attention runs as one block")
    if model.fuses_post_norms:
        problems.append("its post-norms fuse across layers")
    return problems


def attach_step_overlap(platform: Platform, model: object, threshold: int) -> None:
    """Give the model the platform's lanes (``enable_dbo``), before any graph is recorded.

    Args:
        platform: a platform that claims ``step_overlap``.
        model: the loaded model.
        threshold: the fewest sequences of a decode step that runs overlapped.

    Raises:
        EngineConfigError: the model cannot run its steps as overlapped nano-batches (every reason given).
    """
    from engine.models.layers.decoder import DenseDecoder

    if not isinstance(model, DenseDecoder):
        raise EngineConfigError(f"enable_dbo: {type(model).__name__} has no overlapped forward (only the built-in decoders do)")
    problems = overlap_problems(model)
    if problems:
        raise EngineConfigError(f"enable_dbo: {model.config.architecture} cannot overlap its steps: {'; '.join(problems)}")
    model.step_overlap = platform.make_step_overlap()
    model.dbo_threshold = threshold
    logger.info("dual-batch overlap: decode steps of %d or more sequences run as two nano-batches", threshold)


def overlaps_step(
    model: DenseDecoder, num_tokens: int, metadata: AttentionMetadata | GroupedAttentionMetadata, threshold: int
) -> bool:
    """Whether this step runs as two overlapped nano-batches: a pure decode of at least ``threshold``
    sequences, without adapter rows, on a model that overlaps (:func:`overlap_problems` checked at start-up)
    and keeps no layer inputs for a draft head.
    """
    primary = metadata.primary if isinstance(metadata, GroupedAttentionMetadata) else metadata
    return (
        primary.is_pure_decode
        and num_tokens == primary.num_seqs
        and primary.num_seqs >= threshold
        and model.lora_step is None
        and not model.aux_hidden_layers
    )


def _half(
    metadata: AttentionMetadata | GroupedAttentionMetadata, first: int, last: int
) -> AttentionMetadata | GroupedAttentionMetadata:
    # each KV group's tables and slots cut alike: the groups share rows and lengths
    if isinstance(metadata, GroupedAttentionMetadata):
        return GroupedAttentionMetadata([slice_metadata(m, first, last) for m in metadata.by_group], metadata.layer_group)
    return slice_metadata(metadata, first, last)


def forward_overlapped(
    model: DenseDecoder,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[Any],
    metadata: AttentionMetadata | GroupedAttentionMetadata,
    overlap: StepOverlap,
) -> torch.Tensor:
    """The step's hidden states ``[num_tokens, hidden]`` after the final norm, computed as two nano-batches.

    Args:
        model: a model :func:`overlap_problems` finds nothing against.
        input_ids: int64 ``[num_tokens]`` (one token per sequence: a decode step).
        positions: int64 ``[num_tokens]``.
        kv_caches: one cache per layer.
        metadata: the step's description, one per KV group where the model keeps groups
            (:func:`overlaps_step` holds).
        overlap: the platform's lanes.

    Returns:
        The hidden states, rows in the step's order.
    """
    num_seqs = input_ids.shape[0]
    half = num_seqs // 2
    overlap.begin()
    try:  # the lanes are joined and the products given their SMs back whatever happens
        batches = []
        for first, last in ((0, half), (half, num_seqs)):
            meta = _half(metadata, first, last)
            if isinstance(meta, GroupedAttentionMetadata):
                layer_metadata, primary = meta.for_layers(model.spec.attn_soft_cap), meta.primary
            else:
                layer_metadata, primary = model.layer_metadata(meta), meta
            rows = slice(first, last)
            hidden = model.embed_step(input_ids[rows])
            tables = [rotary.step_table(positions[rows], primary) for rotary in model.rotaries]
            batches.append(_NanoBatch(layer_metadata, tables, hidden))
        _run_layers(model, batches, kv_caches, overlap)
        hidden = torch.cat([batch.hidden for batch in batches])
        residual = torch.cat([batch.residual for batch in batches if batch.residual is not None])
    finally:
        overlap.end()
    return model.final_norm_of(hidden, residual)


def _run_layers(model: DenseDecoder, batches: list[_NanoBatch], kv_caches: list[Any], overlap: StepOverlap) -> None:
    # layer by layer, half by half: each half's attention is queued on the attention lane right after its
    # projections, so that the other half's products follow it on the compute lane
    layers = model.layers
    for i in range(len(layers) + 1):
        for batch in batches:
            if batch.attn is not None:
                # the previous layer past its attention, once the attention lane has its result
                overlap.hand_over(Lane.COMPUTE, [batch.attn])
                done = layers[i - 1]
                assert batch.residual is not None  # set by the layer's input norm
                out = done.attention_output(model, batch.attn)
                batch.hidden, batch.residual = done.finish(model, batch.x, out, batch.residual)
                batch.attn = None
            if i == len(layers):
                continue
            layer = layers[i]
            batch.x, batch.residual = layer.attention_norm(model, batch.hidden, batch.residual)
            call = layer.attention_inputs(model, batch.x, batch.tables, batch.layer_metadata[i])
            overlap.hand_over(Lane.ATTENTION, call.tensors())
            with overlap.lane(Lane.ATTENTION):
                batch.attn = layer.attend(model, call, kv_caches[i])

"""Pure-decode steps replayed through the platform's :class:`GraphCapture`, padded to batch-size buckets.

A decode step (one new token per sequence) has the same shapes for every batch of the same size, so a
platform that records graphs (CUDA/HIP graphs) can capture it once per bucket and replay it without
launch overhead. The step's inputs become fixed-shape tensors: a batch is padded up to the next bucket
with rows that write nowhere (slot -1) and attend over nothing (context length 0), and the block table
is padded to the widest table the context limit allows. Prefill steps and batches larger than the
largest bucket run eagerly.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.graph_capture import GraphCapture
from engine.interfaces.lora import LoraStep
from engine.kv_groups import GroupedAttentionMetadata, KVGroupLayout, grouped_metadata

logger = logging.getLogger(__name__)


#: the most block-table cells (rows x the graphs' width) the host lays out itself for a replayed decode
#: (8 rows of an 8k context over blocks of 16); past it a padding op on the device costs less than the
#: host's list work, which grows with the batch
HOST_TABLE_CELLS = 4096


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_batch`` (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes) | {max_batch})


class DecodeGraphs:
    """Captures ``model.forward`` for decode batches and replays it.

    Args:
        model: the core's torch model (``forward(input_ids, positions, kv_caches, metadata)``, ``scale``).
        kv_caches: the per-layer caches (fixed for the engine's life, so graphs may hold them).
        capture: the platform's graph capture.
        max_batch: the largest bucket (the scheduler's ``max_num_seqs``).
        max_model_len: the context limit; fixes the padded block-table width.
        block_size: tokens per KV block.
        device: where the static inputs live.
        sliding_window: the model's attention window, if any.
        kv_layout: the model's KV groups, if it keeps a block table per group: each group then has its
            own static slot mapping and block table.
        lora_slots: the engine's adapter slots (``max_loras``; 0: LoRA off): each row's slot is then a
            static input too (padding rows -1), and the graphs run the adapters' products.
    """

    def __init__(
        self,
        model: Any,
        kv_caches: list[Any],
        capture: GraphCapture,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        sliding_window: int | None = None,
        kv_layout: KVGroupLayout | None = None,
        lora_slots: int = 0,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.graphs = capture
        self.buckets = decode_buckets(max_batch)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.sliding_window = sliding_window
        self.kv_layout = kv_layout
        self.num_groups = len(kv_layout.groups) if kv_layout is not None else 1
        self.lora_slots = lora_slots
        self._query_start = torch.arange(self.buckets[-1] + 1, dtype=torch.int32, device=device)

    @torch.inference_mode()
    def capture(self) -> float:
        """Record every bucket; returns the seconds it took."""
        start = time.perf_counter()
        self.graphs.capture(self._step, self.buckets, self._make_inputs)
        if self.lora_slots:
            self.model.use_lora_step(None)  # the last bucket's plan must not reach an eager step
        seconds = time.perf_counter() - start
        logger.info("decode graphs: %d buckets up to batch %d captured in %.1f s", len(self.buckets), self.buckets[-1], seconds)
        return seconds

    def bucket_for(
        self, input_ids: torch.Tensor, metadata: AttentionMetadata | GroupedAttentionMetadata
    ) -> int | None:
        """The bucket a step replays through, or None when it runs eagerly: not a pure decode, more
        sequences than the largest bucket, or a block table wider than the graphs' (a host-side decision:
        a tensor-parallel driver sends it to the other ranks, which must replay the same bucket)."""
        groups = metadata.by_group if isinstance(metadata, GroupedAttentionMetadata) else [metadata]
        first = groups[0]
        n = first.num_seqs
        if not first.is_pure_decode or input_ids.shape[0] != n or n > self.buckets[-1] or len(groups) != self.num_groups:
            return None
        if any(meta.block_tables.shape[1] > self.max_blocks for meta in groups):
            return None
        return next(b for b in self.buckets if b >= n)

    def padded_shape(self, num_seqs: int, widths: list[int]) -> tuple[int, int | None] | None:
        """The rows and block-table width a pure decode of ``num_seqs`` rows, whose KV groups' tables are
        ``widths`` wide, is replayed with (:meth:`bucket_for`'s bucket; the width None when a table of
        the graphs' width would cost the host more to lay out than a padding op costs the device), or
        None when it runs eagerly. The host lays such a step out in that shape already
        (:func:`engine.step_inputs.prepare_step_inputs`)."""
        if num_seqs > self.buckets[-1] or len(widths) != self.num_groups or max(widths) > self.max_blocks:
            return None
        bucket = next(b for b in self.buckets if b >= num_seqs)
        return bucket, self.max_blocks if bucket * self.max_blocks <= HOST_TABLE_CELLS else None

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata | GroupedAttentionMetadata,
        lora: LoraStep | None = None,
        bucket: int | None = None,
        padded: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor | None:
        """Hidden states ``[num_seqs, hidden]`` of a decode step through its bucket's graph, or None when the
        step is not a pure decode or does not fit a bucket (the caller then runs it eagerly). ``lora``
        gives each row's adapter slot (None: no row has one); ``bucket`` is :meth:`bucket_for`'s answer
        for this step when the caller has it already; ``padded`` the step's inputs the host laid out in
        the bucket's shape (``StepInputs.graph_inputs``), which replace the padding ops."""
        bucket = bucket if bucket is not None else self.bucket_for(input_ids, metadata)
        if bucket is None:
            return None
        groups = metadata.by_group if isinstance(metadata, GroupedAttentionMetadata) else [metadata]
        first = groups[0]
        n = first.num_seqs
        pad = bucket - n
        if padded is not None and padded[0].shape[0] == bucket:
            inputs = list(padded)
            for i in range(4, len(inputs), 2):  # a table the host left at its own width
                if inputs[i].shape[1] != self.max_blocks:
                    inputs[i] = F.pad(inputs[i], (0, self.max_blocks - inputs[i].shape[1], 0, pad))
        else:
            inputs = [F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad)), F.pad(first.seq_lens, (0, pad))]
            for meta in groups:
                inputs.append(F.pad(meta.slot_mapping, (0, pad), value=-1))
                inputs.append(F.pad(meta.block_tables, (0, self.max_blocks - meta.block_tables.shape[1], 0, pad)))
        if self.lora_slots:
            slots = lora.token_slots if lora is not None else torch.full((n,), -1, dtype=torch.int32, device=self.device)
            inputs.append(F.pad(slots, (0, pad), value=-1))
        return self.graphs.run(bucket, *inputs)[:n]

    def _make_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        dev = self.device
        inputs = [
            torch.zeros(batch, dtype=torch.int64, device=dev),
            torch.zeros(batch, dtype=torch.int64, device=dev),
            torch.zeros(batch, dtype=torch.int32, device=dev),
        ]
        for _ in range(self.num_groups):  # each group's slot mapping and block table
            inputs.append(torch.full((batch,), -1, dtype=torch.int64, device=dev))
            inputs.append(torch.zeros((batch, self.max_blocks), dtype=torch.int32, device=dev))
        if self.lora_slots:
            inputs.append(torch.full((batch,), -1, dtype=torch.int32, device=dev))
        return tuple(inputs)

    def _step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        *other_groups: torch.Tensor,
    ) -> torch.Tensor:
        batch = input_ids.shape[0]
        if self.lora_slots:
            *other_groups, token_slots = other_groups
            # planned from the device tensor alone: the graph replays it with each step's slots
            self.model.use_lora_step(LoraStep(token_slots, None, self.lora_slots))
        # host-side fields describe the bucket, not the data: the graph must not depend on context lengths
        metadata = AttentionMetadata(
            query_start_loc=self._query_start[: batch + 1],
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=[self.max_model_len] * batch,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            scale=self.model.scale,
            sliding_window=self.sliding_window,
            # tells backends to pick launch shapes from the bucket alone (the warm-up runs too)
            graph_capture=True,
        )
        if self.kv_layout is None:
            return self.model.forward(input_ids, positions, self.kv_caches, metadata)
        grouped = grouped_metadata(
            metadata, self.kv_layout, [block_tables, *other_groups[1::2]], [slot_mapping, *other_groups[0::2]]
        )
        return self.model.forward(input_ids, positions, self.kv_caches, grouped)

"""One sequence's prompt chunk replayed through the platform's :class:`GraphCapture`, padded to a token bucket.

A prompt step of a single sequence runs every layer's kernels once; run eagerly on a GPU, each launch
costs host time, and for a short prompt the host's share outweighs the device's: the time to the first
token of a lone request is then the launches, not the products. :class:`PrefillGraphs` records such a
step once per token bucket (16, 32, ... up to 512 tokens) and pads a chunk of ``q`` tokens into the next
bucket ``T``, as the verification graphs pad their rows (:mod:`engine.verify_graphs`):

- the padding tokens follow the chunk's own, repeat its last token and position, and write nowhere
  (slot -1); the context counts them (``seq_len + T - q``), so that the real queries keep their positions
  and, the step being causal, never see the keys past them;
- those keys are whatever the block table points at (stale values of the sequence's last block, or block
  0, to which the table is padded): the pool starts zeroed and holds only written values, so the padding
  queries' outputs stay finite, and they are dropped.

The host passes the step's own tensors (padded at the end) and the graph derives the rest (which token
each position repeats, the padded context) on the device. Steps of several sequences, a non-causal step,
a pure decode (the decode graphs take it) or a chunk longer than the largest bucket run eagerly; under
tensor parallelism, LoRA or KV groups the engine records no prefill graphs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.graph_capture import GraphCapture
from engine.kv_groups import GroupedAttentionMetadata

logger = logging.getLogger(__name__)

#: the largest chunk recorded: past it a step's products outweigh its launches even on a fast GPU, and
#: each bucket's activations stay in the graphs' memory pool for the engine's life
MAX_PREFILL_GRAPH_TOKENS = 512


def prefill_buckets(max_tokens: int) -> list[int]:
    """Powers of two from 16 up to ``max_tokens`` (which is always included, if at least 2)."""
    sizes = [b for b in (16, 32, 64, 128, 256, 512) if b < max_tokens]
    return sorted(set(sizes) | {max_tokens}) if max_tokens >= 2 else []


class PrefillGraphs:
    """Captures ``model.forward`` for one sequence's prompt chunk of up to ``max_tokens`` tokens and replays it.

    Args:
        model: the core's torch model (``forward(input_ids, positions, kv_caches, metadata)``, ``scale``).
        kv_caches: the per-layer caches (fixed for the engine's life, so graphs may hold them).
        capture: the platform's graph capture (one of its own: its buckets are token counts).
        max_tokens: the largest bucket (at most :data:`MAX_PREFILL_GRAPH_TOKENS`, the step budget and the
            context limit).
        max_model_len: the context limit; fixes the padded block-table width.
        block_size: tokens per KV block.
        device: where the static inputs live.
        sliding_window: the model's attention window, if any.

    Raises:
        ValueError: ``max_tokens`` is under 2, over :data:`MAX_PREFILL_GRAPH_TOKENS` or over ``max_model_len``.
    """

    def __init__(
        self,
        model: Any,
        kv_caches: list[Any],
        capture: GraphCapture,
        max_tokens: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        sliding_window: int | None = None,
    ) -> None:
        if not 2 <= max_tokens <= MAX_PREFILL_GRAPH_TOKENS:
            raise ValueError(f"a recorded prompt chunk has 2 to {MAX_PREFILL_GRAPH_TOKENS} tokens, got {max_tokens}")
        if max_tokens > max_model_len:
            # a bucket is recorded over a context of its own tokens, which the block table must hold
            raise ValueError(f"the largest prompt bucket ({max_tokens}) exceeds the context limit ({max_model_len})")
        self.model = model
        self.kv_caches = kv_caches
        self.graphs = capture
        self.buckets = prefill_buckets(max_tokens)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.sliding_window = sliding_window
        self._positions = torch.arange(self.buckets[-1], dtype=torch.int64, device=device)
        self._query_start = {t: torch.tensor([0, t], dtype=torch.int32, device=device) for t in self.buckets}

    @torch.inference_mode()
    def capture(self) -> float:
        """Record every bucket; returns the seconds it took."""
        start = time.perf_counter()
        self.graphs.capture(self._step, self.buckets, self._make_inputs)
        seconds = time.perf_counter() - start
        logger.info(
            "prompt graphs: %d buckets up to %d tokens captured in %.1f s", len(self.buckets), self.buckets[-1], seconds
        )
        return seconds

    def bucket_for(self, metadata: AttentionMetadata | GroupedAttentionMetadata) -> int | None:
        """The bucket a step replays through, or None when it runs eagerly (see the module docstring)."""
        if isinstance(metadata, GroupedAttentionMetadata):
            return None
        if metadata.num_seqs != 1 or metadata.is_pure_decode or not metadata.causal:
            return None
        q = metadata.query_lens_cpu[0]
        if q < 2 or q > self.buckets[-1] or metadata.block_tables.shape[1] > self.max_blocks:
            return None
        bucket = next(b for b in self.buckets if b >= q)
        # the padded context must stay inside the graphs' block-table width
        if metadata.seq_lens_cpu[0] + bucket - q > self.max_blocks * self.block_size:
            return None
        return bucket

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, bucket: int
    ) -> torch.Tensor:
        """Hidden states ``[q, hidden]`` of the step through ``bucket``'s graph (from :meth:`bucket_for`);
        a view of the graph's output, overwritten when the bucket replays next."""
        q = input_ids.shape[0]
        pad = bucket - q
        inputs = (
            F.pad(input_ids, (0, pad)),
            F.pad(positions, (0, pad)),
            F.pad(metadata.slot_mapping, (0, pad), value=-1),
            metadata.seq_lens,
            metadata.query_start_loc,
            F.pad(metadata.block_tables, (0, self.max_blocks - metadata.block_tables.shape[1])),
        )
        return self.graphs.run(bucket, *inputs)[:q]

    def _make_inputs(self, tokens: int) -> tuple[torch.Tensor, ...]:
        dev = self.device
        # what a bucket is recorded with: a chunk that fills it, over a context of its own tokens in block 0
        return (
            torch.zeros(tokens, dtype=torch.int64, device=dev),
            torch.arange(tokens, dtype=torch.int64, device=dev),
            torch.full((tokens,), -1, dtype=torch.int64, device=dev),
            torch.full((1,), tokens, dtype=torch.int32, device=dev),
            torch.tensor([0, tokens], dtype=torch.int32, device=dev),
            torch.zeros((1, self.max_blocks), dtype=torch.int32, device=dev),
        )

    def _step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        tokens = input_ids.shape[0]
        real = (query_start[1:] - query_start[:1]).to(torch.int64)  # the chunk's own tokens, [1]
        # each padding position repeats the chunk's last token
        src = torch.minimum(self._positions[:tokens], real - 1)
        # host-side fields describe the bucket, not the data (see AttentionMetadata.graph_capture)
        metadata = AttentionMetadata(
            query_start_loc=self._query_start[tokens],
            seq_lens=(seq_lens + (tokens - real)).to(torch.int32),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            query_lens_cpu=[tokens],
            seq_lens_cpu=[self.max_model_len],
            max_query_len=tokens,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            scale=self.model.scale,
            sliding_window=self.sliding_window,
            graph_capture=True,
        )
        return self.model.forward(
            input_ids.index_select(0, src), positions.index_select(0, src), self.kv_caches, metadata
        )

"""Speculative verification steps replayed through the platform's :class:`GraphCapture`.

A verification step gives each decoding sequence its last token and up to ``k`` proposals: rows of 1 to
``k + 1`` tokens. Run eagerly, such a step costs its launches, which on a GPU outweigh the products of a
small batch: a step of five tokens a sequence took about ten times a replayed decode step (the H200,
``benchmarks/nvidia_h200_speculative.sh``). :class:`VerifyGraphs` records it once per batch-size bucket
with every row ``k + 1`` tokens long, and pads a step into that shape:

- a row shorter than ``k + 1`` gets padding tokens after its own: they repeat its last token and
  position, write nowhere (slot -1), and its context counts them (``seq_len + k + 1 - q``), so that the
  row's real queries keep their positions. The keys a padding query sees past the row's real ones are
  whatever its block table points at: the pool starts zeroed, so they are finite, and the causal mask
  keeps every real query off them;
- a padding row (up to the bucket) has ``k + 1`` tokens over a context of ``k + 1`` keys in block 0;
- the hidden states of the real tokens are gathered back in the step's own order, inside the graph, and
  so are each token's greedy pick and its logprob (the LM head and ``greedy`` in the graph too): a step
  whose rows are all verified greedily then reads those picks back and never computes its logits eagerly.

The host hands the graph the step's own tokens (padded at the end) and one index vector; every gather
runs in the graph, so that the eager operations a step costs stay few: at batch 1 on a GPU each costs
about as much host time as the device spends on a layer.

Steps of other shapes (longer rows, a non-causal step, a pure decode, which the decode graphs take) run
eagerly. Under tensor parallelism, LoRA or KV groups the engine records no verification graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.decode_graphs import decode_buckets
from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.graph_capture import GraphCapture
from engine.kv_groups import GroupedAttentionMetadata

logger = logging.getLogger(__name__)

#: the largest batch recorded: beyond it speculation rarely pays (the switch turns it off) and the graphs'
#: memory and start-up time would grow with every bucket
MAX_VERIFY_BATCH = 64
#: the most tokens a bucket holds (its logits live in the graphs' memory: 512 rows of a 128k vocabulary
#: in bf16 are 131 MB), which caps the batch of long proposals (suffix decoding's 32)
MAX_VERIFY_TOKENS = 512


class VerifyGraphs:
    """Captures ``model.forward`` for verification steps of ``query_len`` tokens a row and replays it.

    Args:
        model: the core's torch model (``forward(input_ids, positions, kv_caches, metadata)``, ``scale``).
        kv_caches: the per-layer caches.
        capture: the platform's graph capture (one of its own: its buckets are not the decode graphs').
        max_batch: the scheduler's ``max_num_seqs`` (the buckets stop at it or :data:`MAX_VERIFY_BATCH`).
        query_len: tokens a row is padded to (``num_speculative_tokens + 1``).
        max_model_len: the context limit; fixes the padded block-table width.
        block_size: tokens per KV block.
        device: where the static inputs live.
        sliding_window: the model's attention window, if any.
        greedy: each logits row's argmax and its logprob (the sampler's ``greedy_on_device``).
    """

    def __init__(
        self,
        model: Any,
        kv_caches: list[Any],
        capture: GraphCapture,
        max_batch: int,
        query_len: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        sliding_window: int | None = None,
        greedy: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        if not 2 <= query_len <= MAX_VERIFY_TOKENS:
            raise ValueError(
                f"a verification row has 2 to {MAX_VERIFY_TOKENS} tokens, got query_len {query_len}"
            )
        self.model = model
        self.kv_caches = kv_caches
        self.graphs = capture
        self.greedy = greedy
        self.buckets = decode_buckets(min(max_batch, MAX_VERIFY_BATCH, MAX_VERIFY_TOKENS // query_len))
        self.query_len = query_len
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.sliding_window = sliding_window
        self._query_start = torch.arange(self.buckets[-1] + 1, dtype=torch.int32, device=device) * query_len

    @torch.inference_mode()
    def capture(self) -> float:
        """Record every bucket; returns the seconds it took."""
        start = time.perf_counter()
        self.graphs.capture(self._step, self.buckets, self._make_inputs)
        seconds = time.perf_counter() - start
        logger.info(
            "verification graphs: %d buckets up to batch %d (%d tokens a row) captured in %.1f s",
            len(self.buckets), self.buckets[-1], self.query_len, seconds,
        )  # fmt: skip
        return seconds

    def bucket_for(self, metadata: AttentionMetadata | GroupedAttentionMetadata) -> int | None:
        """The bucket a step replays through, or None when it runs eagerly (see the module docstring)."""
        if isinstance(metadata, GroupedAttentionMetadata):
            return None
        n = metadata.num_seqs
        q_len = self.query_len
        if not n or metadata.is_pure_decode or not metadata.causal or n > self.buckets[-1]:
            return None
        if metadata.max_query_len > q_len or metadata.block_tables.shape[1] > self.max_blocks:
            return None
        # the padded context of each row must stay inside the graphs' block-table width
        room = self.max_blocks * self.block_size
        if any(s + q_len - q > room for s, q in zip(metadata.seq_lens_cpu, metadata.query_lens_cpu)):
            return None
        return next(b for b in self.buckets if b >= n)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, bucket: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step through ``bucket``'s graph (from :meth:`bucket_for`).

        Returns:
            The hidden states ``[num_tokens, hidden]`` in the step's token order, and float64
            ``[2, num_tokens]``: each token's greedy pick and its raw logprob (None without ``greedy``).
        """
        q_len = self.query_len
        n = metadata.num_seqs
        tokens = bucket * q_len
        src: list[int] = []  # the step's token each padded position copies
        real: list[int] = []  # 1 where that position is the token itself, 0 where it pads
        dst: list[int] = []  # the padded position of each of the step's tokens (then any, up to the bucket)
        start = 0
        for row, q in enumerate(metadata.query_lens_cpu):
            src += [start + min(j, q - 1) for j in range(q_len)]
            real += [1] * q + [0] * (q_len - q)
            dst += range(row * q_len, row * q_len + q)
            start += q
        pad_rows = bucket - n
        src += [0] * (pad_rows * q_len)
        real += [0] * (pad_rows * q_len)
        dst += [0] * (tokens - start)
        seq_lens = [s + q_len - q for s, q in zip(metadata.seq_lens_cpu, metadata.query_lens_cpu)]
        seq_lens += [q_len] * pad_rows
        index = torch.tensor(src + real + dst + seq_lens, dtype=torch.int64)
        if self.device.type != "cpu":
            index = index.pin_memory()
        pad = tokens - start
        inputs = (
            F.pad(input_ids, (0, pad)),
            F.pad(positions, (0, pad)),
            F.pad(metadata.slot_mapping, (0, pad), value=-1),
            index.to(self.device, non_blocking=True),
            F.pad(metadata.block_tables, (0, self.max_blocks - metadata.block_tables.shape[1], 0, pad_rows)),
        )
        hidden, picks = self.graphs.run(bucket, *inputs)
        return hidden[:start], picks[:, :start] if picks is not None else None

    def _make_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        dev = self.device
        tokens = batch * self.query_len
        # the index a padding bucket replays with: every row a padding row, a context of its own tokens in
        # block 0 (zeroed)
        src = torch.zeros(tokens, dtype=torch.int64)
        seq_lens = torch.full((batch,), self.query_len, dtype=torch.int64)
        index = torch.cat((src, src, src, seq_lens)).to(dev)
        return (
            torch.zeros(tokens, dtype=torch.int64, device=dev),
            torch.zeros(tokens, dtype=torch.int64, device=dev),
            torch.full((tokens,), -1, dtype=torch.int64, device=dev),
            index,
            torch.zeros((batch, self.max_blocks), dtype=torch.int32, device=dev),
        )

    def _step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        index: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch = block_tables.shape[0]
        q_len = self.query_len
        tokens = batch * q_len
        src, real, dst, seq_lens = index.split((tokens, tokens, tokens, batch))
        # host-side fields describe the bucket, not the data (see AttentionMetadata.graph_capture)
        metadata = AttentionMetadata(
            query_start_loc=self._query_start[: batch + 1],
            seq_lens=seq_lens.to(torch.int32),
            block_tables=block_tables,
            slot_mapping=torch.where(real.bool(), slot_mapping.index_select(0, src), -1),
            query_lens_cpu=[q_len] * batch,
            seq_lens_cpu=[self.max_model_len] * batch,
            max_query_len=q_len,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            scale=self.model.scale,
            sliding_window=self.sliding_window,
            graph_capture=True,
        )
        padded = self.model.forward(
            input_ids.index_select(0, src), positions.index_select(0, src), self.kv_caches, metadata
        )
        hidden = padded.index_select(0, dst)
        if self.greedy is None:
            return hidden, None
        token_ids, logprobs = self.greedy(self.model.compute_logits(hidden))
        return hidden, torch.stack((token_ids.to(torch.float64), logprobs.to(torch.float64)))

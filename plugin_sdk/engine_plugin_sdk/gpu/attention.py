"""Paged attention through the shared Triton kernels, for any GPU torch drives as ``cuda``.

Cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (keys at 0, values at 1),
the same as the CPU plugin's, so block copies and swaps are one indexed copy on the block axis.

``forward`` writes the new keys and values first and then reads every key from the cache, so one
kernel serves prefill, chunked prefill over a cached prefix, and decode rows in the same batch. A batch
of decode rows only (one new token per sequence) takes the split-context decode kernel instead, which
stores each new key and value itself and attends to them from registers (no separate write launch).
Vendors differ only in the :class:`KernelTuning` they pass.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata, RotaryInput
from engine_plugin_sdk.dtypes import as_copyable
from engine_plugin_sdk.gpu.platform import BLOCK_SIZES, HEAD_SIZES
from engine_plugin_sdk.gpu.triton_kernels import launchers
from engine_plugin_sdk.gpu.triton_kernels.launch import KernelTuning

#: a causal step whose rows bring at most this many tokens each runs them as decode rows (one per token):
#: speculative verification's ``k + 1`` for the usual ``k``; longer rows read their context once a query
#: head in the prefill kernel rather than once a token
SHORT_QUERY_MAX = 8
#: where :meth:`TritonPagedAttentionBackend.short_rows` keeps a step's rows in ``metadata.extras``
SHORT_ROWS_KEY = "gpu_short_rows"


class TritonPagedAttentionBackend(AttentionBackend):
    """Triton paged attention (online softmax, GQA, sliding window, soft-cap) for fp32 / fp16 / bf16.

    Args:
        tuning: the target's launch parameters.
    """

    supported_block_sizes = BLOCK_SIZES
    supported_head_sizes = HEAD_SIZES
    #: the device name error messages mention
    platform_name: ClassVar[str] = "gpu"
    fuses_rotary = True
    fuses_head_norm = True

    def __init__(self, tuning: KernelTuning) -> None:
        self.tuning = tuning
        #: pure-decode batches write the new keys and values inside the decode kernel (False: a separate
        #: write_kv launch first, as for every other batch)
        self.fused_decode_write = True
        # the step whose leading decode rows were last counted, and the count: every layer of a step shares
        # one metadata object, so the count is taken once per step rather than once per layer
        self._leading: tuple[AttentionMetadata, int] | None = None
        # int32 zeros the decode kernel's split programs count themselves in (it leaves them zero): made
        # outside graph capture, kept across steps, so no step spends an operation zeroing them
        self._arrivals: torch.Tensor | None = None

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def write_kv(self, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        launchers.write_kv(key, value, kv_cache, slot_mapping)

    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        return self._attend(query, key, value, kv_cache, metadata, None)

    def forward_rotary(
        self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata, rotary: RotaryInput
    ) -> Any:
        return self._attend(query, key, value, kv_cache, metadata, rotary)

    def _attend(
        self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata, rotary: RotaryInput | None
    ) -> Any:
        check_inputs(query, key, kv_cache, metadata, self.platform_name)
        decode = metadata.num_seqs > 0 and metadata.is_pure_decode and query.shape[0] == metadata.num_seqs
        fused = decode and self.fused_decode_write
        if rotary is not None and not fused:
            # only the fused decode kernel normalises and rotates by itself: every other batch takes the
            # norm and rotary kernels
            if rotary.head_norm is not None:
                norm = rotary.head_norm
                query = launchers.rms_norm(query, norm.q_weight, norm.eps)
                key = launchers.rms_norm(key, norm.k_weight, norm.eps)
            launchers.rotary_embedding(rotary.index, query, key, rotary.table)
            rotary = None
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        common = {"window": metadata.sliding_window, "soft_cap": metadata.logits_soft_cap, "sinks": metadata.sinks}
        # a non-causal step's keys and values are never read again (an encoder's prompt runs in one step,
        # is never prefix-matched and never decodes): its attention reads them from the step's own rows
        # and the cache is not written (on an H200, bge-large: 66 us a layer saved)
        step_kv = not metadata.causal and not decode
        if step_kv:
            key = key if key.stride(-1) == 1 else key.contiguous()
            value = value if value.stride(-1) == 1 else value.contiguous()
        elif not fused:
            launchers.write_kv(key, value, kv_cache, metadata.slot_mapping)
        if decode:
            # fused: the decode kernel writes the new keys and values itself (one launch fewer per layer),
            # and rotates the query and key on the way (one more)
            launchers.paged_decode(
                out, query, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.scale,
                self.decode_splits(metadata, kv_cache.shape[3]), self.tuning, **common,
                new_kv=(key, value, metadata.slot_mapping) if fused else None,
                rotary=(rotary.index, rotary.table) if rotary is not None else None,
                head_norm=rotary.head_norm if rotary is not None else None,
                arrivals=self.decode_arrivals(metadata.num_seqs * kv_cache.shape[3], query.device),
            )  # fmt: skip
        elif (
            metadata.num_seqs and metadata.causal and metadata.max_query_len <= SHORT_QUERY_MAX
            and (metadata.graph_capture or stream_capturing())
        ):  # fmt: skip
            # rows of a few tokens each in a recorded step (speculative verification's graphs): one decode
            # row per token, over the context that ends at it, so that each row's keys are split across
            # programs as a decode's are; the prefill kernel would give a short row a program per head, each
            # reading the whole context alone (on an H200 at batch 1, 11.4 us a layer for five tokens).
            # Recorded steps only: their kernels compile at start-up, where an eager step's split count
            # would be one more variant to compile mid-serving
            tables, lens = self.short_rows(metadata, query.shape[0])
            splits = self.tuning.decode_splits(lens.shape[0], kv_cache.shape[3], None)
            launchers.paged_decode(
                out, query, kv_cache, tables, lens, metadata.scale, splits, self.tuning, **common,
                arrivals=self.decode_arrivals(lens.shape[0] * kv_cache.shape[3], query.device),
            )  # fmt: skip
        elif metadata.num_seqs:
            # a mixed batch leads with its decode rows (one new token each): the decode kernel reads each
            # KV head once for its whole query group, where the prefill kernel's per-head programs would
            # read it once per query head. Only when those rows fill the device without splitting their
            # contexts: a split count would be one more kernel variant to compile mid-serving, for rows
            # too few to matter
            lead = 0 if step_kv else self.leading_decode_rows(metadata)  # the decode kernel reads the cache
            if lead and self.tuning.decode_splits(lead, kv_cache.shape[3], None) == 1:
                launchers.paged_decode(
                    out[:lead], query[:lead], kv_cache, metadata.block_tables[:lead], metadata.seq_lens[:lead],
                    metadata.scale, 1, self.tuning, **common,
                )  # fmt: skip
            else:
                lead = 0
            if lead < metadata.num_seqs:
                launchers.paged_prefill(
                    out, query, kv_cache, metadata.block_tables[lead:], metadata.seq_lens[lead:],
                    metadata.query_start_loc[lead:], metadata.max_query_len, metadata.scale, self.tuning,
                    causal=metadata.causal, step_kv=(key, value) if step_kv else None, **common,
                )  # fmt: skip
        return out

    def short_rows(self, metadata: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each new token as a decode row: its sequence's block table and the length of the context that
        ends at it, ``[num_tokens, blocks]`` and ``[num_tokens]``. Device operations on shapes the batch
        fixes (a captured graph replays them), made once per step and kept in ``metadata.extras``."""
        kept = metadata.extras.get(SHORT_ROWS_KEY)
        if kept is not None:
            return kept
        ends = metadata.query_start_loc[1:]
        token = torch.arange(num_tokens, dtype=ends.dtype, device=ends.device)
        # a token past the last row (none in a step the engine builds) is given to the last row
        row = torch.searchsorted(ends, token, right=True).clamp_(max=ends.shape[0] - 1)
        lens = metadata.seq_lens.index_select(0, row) - (ends.index_select(0, row) - 1 - token)
        kept = (metadata.block_tables.index_select(0, row), lens.to(torch.int32))
        metadata.extras[SHORT_ROWS_KEY] = kept
        return kept

    def gather_kv(self, kv_cache: Any, block_ids: list[int]) -> tuple[Any, Any]:
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
        kv = as_copyable(kv_cache).index_select(1, ids).view(kv_cache.dtype)
        _, n, bs, heads, dim = kv.shape
        return kv[0].reshape(n * bs, heads, dim), kv[1].reshape(n * bs, heads, dim)

    def decode_splits(self, metadata: AttentionMetadata, num_kv_heads: int) -> int:
        """Programs per sequence context; under graph capture it depends on the batch only."""
        # a captured graph replays with other context lengths: its split count may not depend on them
        capturing = metadata.graph_capture or stream_capturing()
        max_len = None if capturing else metadata.max_seq_len
        return self.tuning.decode_splits(metadata.num_seqs, num_kv_heads, max_len)

    def decode_arrivals(self, count: int, device: torch.device) -> torch.Tensor | None:
        """At least ``count`` arrival counts (zeros between launches), or None when the tuning merges in
        a kernel of its own, or while a graph is captured and the kept ones are too few."""
        if not self.tuning.decode_merge_last:
            return None
        kept = self._arrivals
        # "cuda" and "cuda:0" are the same device to a caller that names no index
        if (
            kept is not None and kept.numel() >= count
            and kept.device.type == device.type and device.index in (None, kept.device.index)
        ):
            return kept
        if stream_capturing():
            return None
        self._arrivals = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        return self._arrivals

    def leading_decode_rows(self, metadata: AttentionMetadata) -> int:
        """How many sequences at the front of the batch have exactly one new token (counted once per step)."""
        if self._leading is None or self._leading[0] is not metadata:
            self._leading = (metadata, leading_decode_rows(metadata.query_lens_cpu))
        return self._leading[1]


def leading_decode_rows(query_lens: list[int]) -> int:
    """How many of ``query_lens`` at the front are exactly 1."""
    return next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))


def stream_capturing() -> bool:
    """Whether the current stream (CUDA or HIP) is being captured into a graph (False on the CPU)."""
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_inputs(query: Any, key: Any, kv_cache: Any, metadata: AttentionMetadata, platform_name: str = "gpu") -> None:
    """Raise ValueError, in one line, for tensors and metadata that do not fit together."""
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError("query, key and value must be [num_tokens, heads, head_dim]")
    num_tokens, num_heads, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} disagree on tokens or head_dim")
    if num_heads % key.shape[1]:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {key.shape[1]}")
    if head_dim not in HEAD_SIZES:
        raise ValueError(f"head size {head_dim} is not supported on {platform_name} (supported: {list(HEAD_SIZES)})")
    if metadata.block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block size {metadata.block_size} is not supported on {platform_name} (supported: {list(BLOCK_SIZES)})"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    if kv_cache.shape[2] != metadata.block_size or tuple(kv_cache.shape[3:]) != (key.shape[1], head_dim):
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} does not match block_size {metadata.block_size}, "
            f"{key.shape[1]} kv heads, head_dim {head_dim}"
        )

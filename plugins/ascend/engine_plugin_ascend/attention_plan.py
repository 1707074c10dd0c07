"""Turns one step's :class:`AttentionMetadata` into fused-attention launches, once for all layers.

The batch is split by query length. Decode rows (one new token) go to one launch with an ``S == 1``
BSND query, the fused op's incremental branch, which needs no mask. Prefill and chunked-prefill
sequences go to a second launch: their rows are scattered into a zero-padded ``[B, max_query_len]``
BSND query, attended with ``sparse_mode=3`` (rightDownCausal, so a chunk's queries are the last
positions of their context), and gathered back. Everything here is index bookkeeping on host lists;
the only device work is copying the small index tensors once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine_plugin_sdk import AttentionMetadata

#: sparse_mode values of npu_fused_infer_attention_score used here
SPARSE_NONE = 0
SPARSE_RIGHT_DOWN_CAUSAL = 3
#: why a non-causal (encoder) step is refused
NON_CAUSAL_REFUSED = (
    "the Ascend plugin's attention has no non-causal attention (non_causal_attention is not claimed)"
)

@dataclass(frozen=True, slots=True)
class AttentionLaunch:
    """The arguments of one fused-attention call over some of the batch's sequences.

    Attributes:
        rows: flat token rows (of ``query`` and the output) this launch covers, in launch order; None
            means every row in order.
        padded_rows: where each of those rows sits in the ``[batch * max_query_len]`` padded query;
            None when ``max_query_len == 1`` (no padding).
        batch: sequences in the launch (B).
        max_query_len: S of the BSND query.
        block_table: int32 ``[batch, max_blocks]``.
        query_lens: per-sequence query lengths (``actual_seq_lengths``); None for decode.
        seq_lens: per-sequence context lengths (``actual_seq_lengths_kv``).
        sparse_mode: 0 for decode, 3 (rightDownCausal) for prefill.
    """

    rows: torch.Tensor | None
    padded_rows: torch.Tensor | None
    batch: int
    max_query_len: int
    block_table: torch.Tensor
    query_lens: list[int] | None
    seq_lens: list[int]
    sparse_mode: int


@dataclass(frozen=True, slots=True)
class AscendStepPlan:
    """Every launch of a step, the int32 write slots, and the metadata tensors it was built from."""

    launches: tuple[AttentionLaunch, ...]
    slot_indices: torch.Tensor
    sources: tuple[Any, Any, Any]


def check_supported_features(metadata: AttentionMetadata) -> None:
    """Refuse the attention features this plugin does not claim.

    Raises:
        ValueError: for a sliding window, a soft-cap, or a step recorded into a graph.
        NotImplementedError: for a non-causal (encoder) step: the plan has no launch without the causal
            mask (``non_causal_attention`` is not claimed).
    """
    if metadata.sliding_window is not None:
        raise ValueError("sliding-window attention is not supported on npu")
    if metadata.logits_soft_cap is not None:
        raise ValueError("logits soft-capping is not supported on npu")
    if not metadata.causal:
        raise NotImplementedError(NON_CAUSAL_REFUSED)
    if metadata.graph_capture:
        raise ValueError(
            "attention on npu cannot be captured in a decode graph yet: the fused attention takes sequence "
            "lengths as host arguments, which a graph would freeze"
        )


def _starts(query_lens: list[int]) -> list[int]:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


def _validate(metadata: AttentionMetadata, num_tokens: int) -> None:
    q_lens, s_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
    if len(q_lens) != len(s_lens) or not q_lens:
        raise ValueError(f"metadata has {len(q_lens)} query lengths and {len(s_lens)} sequence lengths")
    if sum(q_lens) != num_tokens:
        raise ValueError(f"query has {num_tokens} rows but the query lengths sum to {sum(q_lens)}")
    for q, s in zip(q_lens, s_lens, strict=True):
        if not 1 <= q <= s:
            raise ValueError(f"each sequence needs 1 <= query_len <= seq_len, got {q} and {s}")
    table = metadata.block_tables
    if table.dim() != 2 or table.shape[0] != len(q_lens):
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(table.shape)}")
    if table.shape[1] * metadata.block_size < max(s_lens):
        raise ValueError(
            f"block_tables has {table.shape[1]} columns of {metadata.block_size} tokens for a "
            f"sequence of {max(s_lens)}"
        )


def build_step_plan(metadata: AttentionMetadata, num_tokens: int) -> AscendStepPlan:
    """Plan the launches for one step.

    Args:
        metadata: the step's batch description.
        num_tokens: rows of the flat query.

    Raises:
        ValueError: for inconsistent metadata or an unclaimed feature.
        NotImplementedError: for a non-causal step (see :func:`check_supported_features`).
    """
    check_supported_features(metadata)
    _validate(metadata, num_tokens)
    q_lens, s_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
    device = metadata.block_tables.device
    table = metadata.block_tables.to(torch.int32)
    starts = _starts(q_lens)
    decode = [i for i, q in enumerate(q_lens) if q == 1]
    prefill = [i for i, q in enumerate(q_lens) if q > 1]

    def subset(seqs: list[int]) -> torch.Tensor:
        if len(seqs) == len(q_lens):
            return table
        return table.index_select(0, torch.tensor(seqs, dtype=torch.long, device=device))

    launches = []
    if decode:
        everything = len(decode) == len(q_lens)
        rows = (
            None if everything else torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device)
        )
        launches.append(
            AttentionLaunch(
                rows=rows,
                padded_rows=None,
                batch=len(decode),
                max_query_len=1,
                block_table=subset(decode),
                query_lens=None,
                seq_lens=[s_lens[i] for i in decode],
                sparse_mode=SPARSE_NONE,
            )
        )
    if prefill:
        width = max(q_lens[i] for i in prefill)
        rows_list: list[int] = []
        padded_list: list[int] = []
        for b, i in enumerate(prefill):
            rows_list.extend(range(starts[i], starts[i + 1]))
            padded_list.extend(range(b * width, b * width + q_lens[i]))
        launches.append(
            AttentionLaunch(
                rows=torch.tensor(rows_list, dtype=torch.long, device=device),
                padded_rows=torch.tensor(padded_list, dtype=torch.long, device=device),
                batch=len(prefill),
                max_query_len=width,
                block_table=subset(prefill),
                query_lens=[q_lens[i] for i in prefill],
                seq_lens=[s_lens[i] for i in prefill],
                sparse_mode=SPARSE_RIGHT_DOWN_CAUSAL,
            )
        )
    slots = metadata.slot_mapping.reshape(-1)
    if slots.numel() != num_tokens:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {num_tokens} tokens")
    sources = (metadata.block_tables, metadata.seq_lens, metadata.slot_mapping)
    return AscendStepPlan(tuple(launches), slots.to(torch.int32), sources)

"""Pipeline micro-batches: how a step's sequences are cut (every rank cuts alike)."""

from __future__ import annotations

import torch

from engine.interfaces.attention import AttentionMetadata
from engine.parallel.micro_batches import split_micro_batches


def _metadata(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(len(seq_lens) * 3, dtype=torch.int32).view(len(seq_lens), 3),
        slot_mapping=torch.arange(sum(query_lens), dtype=torch.int64) + 100,
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_size=16, scale=0.125, extras={"plan": object()},
    )  # fmt: skip


def test_groups_are_consecutive_balanced_by_tokens_and_never_empty():
    meta = _metadata([10, 1, 1, 1, 9], [30, 5, 6, 7, 9])
    sampled = torch.tensor([9, 10, 11, 12, 21])  # each sequence's last row
    batches = split_micro_batches(meta, sampled, 2)
    assert [b.tokens for b in batches] == [slice(0, 11), slice(11, 22)]
    first, second = (b.metadata for b in batches)
    assert first.query_lens_cpu == [10, 1] and second.query_lens_cpu == [1, 1, 9]
    assert second.query_start_loc.tolist() == [0, 1, 2, 11] and second.max_seq_len == 9
    assert second.slot_mapping.tolist() == list(range(111, 122)) and second.block_tables[0, 0].item() == 6
    assert first.extras == {}  # a backend's plan for the whole step must not reach a part of it
    assert batches[0].logits_rows.tolist() == [9, 10] and batches[1].logits_rows.tolist() == [0, 1, 10]
    # more groups than sequences: one sequence each; and a group with no sampled row has none to pick
    singles = split_micro_batches(_metadata([4, 4], [4, 4]), torch.tensor([7]), 5)
    assert [b.tokens for b in singles] == [slice(0, 4), slice(4, 8)]
    assert singles[0].logits_rows is None and singles[1].logits_rows.tolist() == [3]

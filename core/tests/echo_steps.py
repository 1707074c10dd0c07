"""A model that echoes its inputs, and causal steps to feed it: for the graph-padding tests (verification and
prompt graphs), which check what the recorded step is run with and what comes back."""

from __future__ import annotations

from typing import Any

import torch

from engine.interfaces.attention import AttentionMetadata


class EchoModel:
    """Returns each token's id and position as its hidden state, and records what it was run with."""

    scale = 0.125

    def __init__(self) -> None:
        self.seen: list[tuple[AttentionMetadata, torch.Tensor, torch.Tensor]] = []

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, metadata: AttentionMetadata
    ) -> torch.Tensor:
        self.seen.append((metadata, input_ids, positions))
        return torch.stack((input_ids, positions), dim=1).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over 8 tokens whose argmax is each row's token id modulo 8."""
        return torch.nn.functional.one_hot(hidden[:, 0].long() % 8, 8).float()


def step(
    query_lens: list[int], seq_lens: list[int], block_size: int = 4
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A causal step of rows of ``query_lens`` new tokens ending contexts of ``seq_lens`` (fresh random ids)."""
    ids, pos, slots = [], [], []
    generator = torch.Generator().manual_seed(sum(seq_lens))
    for row, (q, s) in enumerate(zip(query_lens, seq_lens)):
        ids += torch.randint(1, 1000, (q,), generator=generator).tolist()
        pos += range(s - q, s)
        slots += [1000 * (row + 1) + p for p in range(s - q, s)]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    blocks = -(-max(seq_lens) // block_size)
    metadata = AttentionMetadata(
        query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(1, 1 + len(seq_lens) * blocks, dtype=torch.int32).view(len(seq_lens), blocks),
        slot_mapping=torch.tensor(slots), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size, scale=0.125,
    )  # fmt: skip
    return torch.tensor(ids), torch.tensor(pos), metadata

"""Tensor parallelism: which slice of each weight a rank holds, and the reductions that join them.

Megatron's split: the fused q/k/v and gate/up projections are split by output rows (each rank owns whole
attention heads and a slice of the MLP's columns), the output and down projections by input columns,
whose partial products every rank sums (one all-reduce per branch). The lm_head is split by vocabulary
rows and its logits gathered. With fewer KV heads than ranks, each KV head is held by the ranks whose
query heads read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.interfaces.communicator import Communicator
    from engine.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group.

    Attributes:
        rank: this process's rank.
        size: ranks in the group.
        comm: the group's communicator.
        expert_parallel: a mixture of experts' experts are divided among the ranks (each holds whole
            experts) rather than each expert split across them.
    """

    rank: int
    size: int
    comm: Communicator
    expert_parallel: bool = False

    def heads(self, total: int) -> tuple[int, int]:
        """``(first, count)`` of the query heads this rank owns (``total`` divisible by ``size``)."""
        count = total // self.size
        return self.rank * count, count

    def kv_heads(self, total: int) -> tuple[int, int]:
        """``(first, count)`` of the KV heads this rank holds: its share, or the one head its query
        heads read when there are fewer KV heads than ranks (replicated)."""
        if total >= self.size:
            count = total // self.size
            return self.rank * count, count
        return self.rank * total // self.size, 1

    def rows(self, total: int) -> slice:
        """This rank's equal slice of ``total`` (divisible by ``size``)."""
        count = total // self.size
        return slice(self.rank * count, (self.rank + 1) * count)

    def vocab_rows(self, vocab: int) -> tuple[slice, int]:
        """This rank's slice of the vocabulary and the padded rows per rank (the last rank's slice may be
        short: its rows are padded with zeros so that every rank gathers the same width)."""
        per_rank = -(-vocab // self.size)
        start = min(vocab, self.rank * per_rank)
        return slice(start, min(vocab, start + per_rank)), per_rank

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial product (row-parallel projections)."""
        return self.comm.all_reduce(partial.contiguous())

    def gather_logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """Every rank's logits columns side by side, the padding cut off."""
        return self.comm.all_gather(local.contiguous(), dim=-1)[:, :vocab]


def tensor_parallel_problems(config: ModelConfig, size: int, qk_norm: str) -> list[str]:
    """Why ``config`` cannot be split ``size`` ways (empty when it can).

    Args:
        config: the model's sizes.
        size: the tensor-parallel size.
        qk_norm: the architecture's q/k norm kind (``"full"`` normalises across every head at once).
    """
    problems = []
    if config.num_heads % size:
        problems.append(f"{config.num_heads} attention heads do not split over tensor_parallel_size {size}")
    kv = config.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads do not split over (or replicate across) tensor_parallel_size {size}")
    if config.intermediate_size % size:
        problems.append(f"intermediate size {config.intermediate_size} does not split over tensor_parallel_size {size}")
    if qk_norm == "full":
        problems.append(f"{config.architecture}'s q/k norm spans every head, which tensor parallelism does not split yet")
    return problems

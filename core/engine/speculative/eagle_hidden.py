"""The target's hidden states an EAGLE head reads, kept beside the target's KV cache, block for block.

Each target block has a slab of ``block_size`` hidden-state rows next to its KV: every step writes the rows
of the tokens it computes at their KV slots (the forward's output, after the final norm, for EAGLE-1; the
inputs of three target layers, concatenated, for EAGLE-3), and the step's block moves (copy-on-write,
swaps) move the slabs too. A block holds the rows of the tokens whose KV it holds, so:

- a block the target takes from its prefix cache brings the rows its first computation wrote: the head
  reads the same states whether the prefix was cached or not (its proposals, and so a seeded request's
  random draws, do not depend on what the cache held);
- a position computed again (a rejected proposal's, a preempted sequence's) holds its newest row;
- nothing piles up: the slabs are part of the pool's memory budget (``bytes_per_block``).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.hybrid_block_manager import HybridBlockManager
from engine.kv_groups import GroupedAttentionMetadata
from engine.scheduler import SchedulerOutput


class HiddenStore:
    """Hidden-state rows of the target's KV blocks.

    Args:
        width: the row width (the hidden size; three times it for EAGLE-3).
        block_manager: the target's block tables (the first KV group's, with several).
        num_blocks: blocks in the target's pool.
        dtype: the rows' dtype (the target's).
        device: where the slabs live.
        aux_model: EAGLE-3: the target model whose ``aux_hidden_states`` (the captured layer inputs) are
            kept instead of the forward's output; None for EAGLE-1.
    """

    def __init__(
        self,
        width: int,
        block_manager: BlockManager | HybridBlockManager,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        aux_model: Any = None,
    ) -> None:
        self.width = width
        self.block_manager = block_manager.groups[0]
        self.block_size = self.block_manager.block_size
        self.aux_model = aux_model
        self.slabs = torch.zeros(num_blocks * self.block_size, width, dtype=dtype, device=device)
        #: swapped-out blocks' rows by host block, on the host
        self._host: dict[int, torch.Tensor] = {}

    @staticmethod
    def bytes_per_block(width: int, block_size: int, element_size: int) -> int:
        """The memory one block's slab takes."""
        return width * block_size * element_size

    @property
    def needs_eager(self) -> bool:
        """Whether steps must run eagerly: decode graphs record the forward's output, not the layer
        inputs EAGLE-3 reads."""
        return self.aux_model is not None

    def keep(self, step: SchedulerOutput, hidden: torch.Tensor, metadata: Any) -> None:
        """Apply the step's block moves to the slabs, then write its rows at their KV slots.

        Args:
            step: the step (its swaps and copies, done on the KV pool before the forward).
            hidden: the forward's output ``[rows, hidden]``.
            metadata: the step's attention metadata (its slot mapping; the first group's with several).
        """
        self._move(step)
        rows = torch.cat(self.aux_model.aux_hidden_states, dim=-1) if self.aux_model is not None else hidden
        if isinstance(metadata, GroupedAttentionMetadata):
            metadata = metadata.primary
        slots = metadata.slot_mapping.to(torch.long)
        self.slabs.index_copy_(0, slots, rows[: slots.shape[0]].to(self.slabs.dtype))

    def gather(self, seq_id: int, first: int, last: int) -> torch.Tensor:
        """The rows of positions ``first .. last`` of a running sequence (zeros where its table holds no
        block, or the null block of a released window).

        Returns:
            ``[last - first + 1, width]``.
        """
        bm, bs = self.block_manager, self.block_size
        table = bm.block_tables.get(seq_id, [])
        positions = range(first, last + 1)
        blocks = [table[p // bs] if p // bs < len(table) else None for p in positions]
        missing = [i for i, b in enumerate(blocks) if b is None or b == bm.null_block]
        slots = [0 if b is None else b * bs + p % bs for b, p in zip(blocks, positions)]
        rows = self.slabs.index_select(0, torch.tensor(slots, device=self.slabs.device))
        if missing:
            rows[torch.tensor(missing, device=rows.device)] = 0
        return rows

    def _move(self, step: SchedulerOutput) -> None:
        # the order of apply_block_moves: swap-outs, copies, swap-ins
        bs = self.block_size
        view = self.slabs.view(-1, bs, self.width)
        for device_block, host_block in step.swap_out:
            self._host[host_block] = view[device_block].to("cpu", copy=True)
        for src, dst in step.copies:
            view[dst] = view[src]
        for host_block, device_block in step.swap_in:
            saved = self._host.pop(host_block, None)
            if saved is not None:
                view[device_block] = saved.to(view.device)

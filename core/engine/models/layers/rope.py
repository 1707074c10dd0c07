"""Rotary embeddings at run time: full or partial width, one table or chosen per sequence.

Plain, ``linear``, ``llama3`` and ``yarn`` RoPE index one precomputed table by position, as before.
``longrope`` keeps its short and long tables stacked and sends each token to the long half when its
sequence is longer than ``original_max_position_embeddings``; ``dynamic`` computes each token's row
from its own sequence's length. Both read the lengths from the step's ``AttentionMetadata`` tensors
(not the host lists), so a recorded decode graph stays valid.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.ops import OpTable
from engine.models.layers.spec import RopeSpec
from engine.models.rotary import build_cos_sin_cache, dynamic_theta, rope_type


def token_sequence_lengths(metadata: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """int64 ``[num_tokens]``: the context length of the sequence each token of the step belongs to."""
    starts = metadata.query_start_loc[1:].to(torch.int64)
    rows = torch.arange(num_tokens, device=starts.device)
    seq_of_row = torch.searchsorted(starts, rows, right=True).clamp_max(starts.numel() - 1)
    return metadata.seq_lens.to(torch.int64).index_select(0, seq_of_row)


class RotaryEmbedding:
    """One :class:`RopeSpec` made runnable.

    Args:
        spec: the rotary's base, scaling and width.
        max_position: the model's ``max_position_embeddings`` (rows of the tables).
        device: where the tables live.
    """

    def __init__(self, spec: RopeSpec, max_position: int, device: Any) -> None:
        self.spec = spec
        self.kind = rope_type(spec.scaling)
        self.max_position = max_position
        self.rotary_dim = spec.rotary_dim
        self.original_max = 0
        if self.kind == "dynamic":
            # the tables follow the sequence; only the exponents are fixed
            self.exponents = (torch.arange(0, spec.rotary_dim, 2, dtype=torch.int64).float() / spec.rotary_dim).to(device)
            assert spec.scaling is not None
            self.factor = float(spec.scaling["factor"])
            # the config's max_position_embeddings, before the engine widened the context by ``factor``
            self.original_max = int(spec.scaling["original_max_position_embeddings"])
            self.cache = torch.empty(0, device=device)
        elif self.kind == "longrope":
            assert spec.scaling is not None
            self.original_max = int(spec.scaling["original_max_position_embeddings"])
            short = build_cos_sin_cache(spec.rotary_dim, max_position, spec.theta, spec.scaling, device)
            long = build_cos_sin_cache(spec.rotary_dim, max_position, spec.theta, spec.scaling, device, self.original_max + 1)
            self.cache = torch.cat([short, long])
        else:
            self.cache = build_cos_sin_cache(spec.rotary_dim, max_position, spec.theta, spec.scaling, device)

    def step_table(self, positions: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The (row index per token, table) pair :meth:`apply` takes for one step.

        Args:
            positions: int64 ``[num_tokens]``.
            metadata: the step's batch description.

        Returns:
            Indices into the table and the float32 table ``[rows, rotary_dim]``.
        """
        if self.kind == "longrope":
            is_long = token_sequence_lengths(metadata, positions.shape[0]) > self.original_max
            return positions + is_long.to(positions.dtype) * self.max_position, self.cache
        if self.kind == "dynamic":
            lengths = token_sequence_lengths(metadata, positions.shape[0])
            base = dynamic_theta(self.spec.theta, self.factor, self.rotary_dim, self.original_max, lengths)
            inv_freq = 1.0 / (base.unsqueeze(1) ** self.exponents.unsqueeze(0))
            freqs = positions.float().unsqueeze(1) * inv_freq
            table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
            return torch.arange(positions.shape[0], device=positions.device), table
        return positions, self.cache

    def apply(
        self, ops: OpTable, index: torch.Tensor, table: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H, D]`` and ``k [T, KVH, D]`` (their first ``rotary_dim`` dims) by ``table[index]``."""
        if self.rotary_dim == q.shape[-1]:
            return ops.rotary_embedding(index, q, k, table)
        r = self.rotary_dim
        q_rot, k_rot = ops.rotary_embedding(index, q[..., :r].contiguous(), k[..., :r].contiguous(), table)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


def interleaved_to_halves(rows: torch.Tensor, num_heads: int, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Reorder each head's first ``rotary_dim`` output rows from GLM's ``(2i, 2i+1)`` pairs to NeoX halves.

    Q and K get the same permutation, so their dot products (and the attention) are unchanged while a
    rotate-half rotary applies GLM's pairwise rotation.

    Args:
        rows: a Q or K projection weight ``[num_heads * head_dim, in]`` or bias ``[num_heads * head_dim]``.
        num_heads: heads in ``rows``.
        head_dim: size of one head.
        rotary_dim: the rotated width.

    Returns:
        The permuted tensor.
    """
    within = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2), torch.arange(rotary_dim, head_dim)])
    order = (torch.arange(num_heads).unsqueeze(1) * head_dim + within.unsqueeze(0)).reshape(-1)
    return rows.index_select(0, order.to(rows.device))

"""Random paged-attention problems: a batch, its block tables, its metadata, and the float64 answer.

A problem scatters each sequence over random physical blocks of a large pool, so a backend that reads
blocks in order, ignores the block table, or writes to the wrong slot gets a wrong answer; the rest of
the cache holds random garbage (not zeros) for the same reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine_plugin_sdk.reference_ops import F64, ref_attention
from engine_plugin_sdk.tolerances import Tolerance, get_tolerance


@dataclass(slots=True)
class AttentionProblem:
    """One flat batch of new tokens over paged per-sequence histories.

    Attributes:
        query: ``[num_tokens, num_heads, head_dim]`` in ``dtype`` on ``device``.
        key: ``[num_tokens, num_kv_heads, head_dim]``, the new tokens' keys.
        value: like ``key``.
        key_history: per sequence ``[context_len, num_kv_heads, head_dim]``, new tokens last.
        value_history: like ``key_history``.
        query_lens: new tokens per sequence.
        seq_lens: context length per sequence, new tokens included.
        block_tables: physical block ids per sequence, logical order.
        metadata: the :class:`AttentionMetadata` to pass to ``backend.forward``.
        prefix_key: keys of every already-cached token, flat ``[num_prefix, num_kv_heads, head_dim]``.
        prefix_value: like ``prefix_key``.
        prefix_slot_mapping: int64 cache slot of each prefix token.
        num_blocks, block_size, num_kv_heads, head_dim: cache geometry.
        dtype: the activation dtype; kv_cache_dtype: the cache dtype.
        device: where the tensors live.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_history: list[torch.Tensor]
    value_history: list[torch.Tensor]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    metadata: AttentionMetadata
    prefix_key: torch.Tensor
    prefix_value: torch.Tensor
    prefix_slot_mapping: torch.Tensor
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    device: torch.device
    extras: dict[str, Any] = field(default_factory=dict)

    def allocate_cache(
        self, backend: AttentionBackend, fill_random: bool = True, seed: int = 1234
    ) -> torch.Tensor:
        """One layer's cache in the backend's layout.

        Args:
            backend: decides the shape through :meth:`AttentionBackend.kv_cache_shape`.
            fill_random: fill with random values so reads of unwritten slots are caught; turn off for
                huge caches whose untouched pages should stay unallocated.
            seed: seed of the garbage.
        """
        shape = backend.kv_cache_shape(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        cache = torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
        if fill_random:
            gen = torch.Generator().manual_seed(seed)
            cache.copy_(torch.randn(shape, generator=gen).to(self.kv_cache_dtype))
        return cache

    def fill_cache(self, backend: AttentionBackend, kv_cache: torch.Tensor) -> None:
        """Store every sequence's already-cached prefix through ``backend.write_kv``."""
        if self.prefix_slot_mapping.numel():
            backend.write_kv(self.prefix_key, self.prefix_value, kv_cache, self.prefix_slot_mapping)

    def reference_output(self) -> torch.Tensor:
        """The float64 answer, with keys and values rounded to the cache dtype as a cache stores them."""
        keys = [k.to(self.kv_cache_dtype).to(F64) for k in self.key_history]
        values = [v.to(self.kv_cache_dtype).to(F64) for v in self.value_history]
        md = self.metadata
        return ref_attention(
            self.query,
            keys,
            values,
            self.query_lens,
            md.scale,
            md.causal,
            md.sliding_window,
            md.logits_soft_cap,
            md.sinks,
        )

    def run(self, backend: AttentionBackend, kv_cache: torch.Tensor | None = None) -> torch.Tensor:
        """Allocate (unless given) and fill a cache, then return ``backend.forward``'s output."""
        if kv_cache is None:
            kv_cache = self.allocate_cache(backend)
        self.fill_cache(backend, kv_cache)
        return backend.forward(self.query, self.key, self.value, kv_cache, self.metadata)

    def tolerance(self) -> Tolerance:
        """The tolerance for this problem's dtype and cache dtype."""
        return get_tolerance(self.dtype, self.kv_cache_dtype)


def make_attention_problem(
    num_seqs: int,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
    seed: int = 0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_cache_dtype: torch.dtype | None = None,
    block_pool: Sequence[int] | None = None,
    extra_table_columns: int = 1,
    release_out_of_window: bool = False,
    scale: float | None = None,
    sinks: bool = False,
    causal: bool = True,
) -> AttentionProblem:
    """Build a random paged-attention problem.

    Args:
        num_seqs: sequences in the batch.
        query_lens: new tokens per sequence (1 for decode, the whole context for a prefill, in between for a
            chunk of a prefill over a cached prefix).
        context_lens: total tokens per sequence, new ones included.
        num_heads: query heads; a multiple of ``num_kv_heads`` (GQA; ``num_kv_heads == 1`` is MQA).
        num_kv_heads: key/value heads.
        head_dim: head size.
        block_size: tokens per block.
        num_blocks: physical blocks in the pool.
        dtype: query/key/value dtype.
        device: where the tensors go.
        seed: the random seed; the same arguments and seed give the same problem.
        sliding_window: attention window, or None.
        soft_cap: logit soft-cap, or None.
        kv_cache_dtype: cache dtype; ``dtype`` when None.
        block_pool: physical block ids to draw from (default: all); the suite passes the top of a huge pool
            to test 64-bit cache offsets.
        extra_table_columns: padding columns (zeros) appended to every block table row.
        release_out_of_window: with a window, point the table entries of blocks wholly before each
            sequence's first query's window at one shared block of unrelated values, as the engine does
            once it released them (their tokens are never written): the output must not change.
        scale: softmax scale; ``head_dim ** -0.5`` when None. Models such as Gemma use another one, so a
            backend that recomputes the default instead of reading ``metadata.scale`` must fail.
        sinks: give every head a random attention sink (``metadata.sinks``, float32, spread so that some
            heads give the sink most of their weight and others almost none).
        causal: False builds an encoder step (``metadata.causal=False``: every token sees its whole
            sequence, later positions included), whose reference is computed without the causal mask.
            Only defined where each sequence's query is its whole context, so ``query_lens`` must equal
            ``context_lens`` (no cached prefix).

    Returns:
        The :class:`AttentionProblem`.

    Raises:
        ValueError: for inconsistent lengths, more blocks needed than the pool has, or a non-causal
            problem over a cached prefix.
    """
    query_lens, context_lens = list(query_lens), list(context_lens)
    if len(query_lens) != num_seqs or len(context_lens) != num_seqs:
        raise ValueError(f"query_lens and context_lens need {num_seqs} entries each")
    for q, c in zip(query_lens, context_lens, strict=True):
        if not 1 <= q <= c:
            raise ValueError(f"each sequence needs 1 <= query_len <= context_len, got {q} and {c}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not causal and query_lens != context_lens:
        # the contract (Capabilities.non_causal_attention) says nothing of non-causal chunks over a prefix
        raise ValueError(
            f"a non-causal problem needs query_lens == context_lens (no cached prefix), got {query_lens} "
            f"and {context_lens}"
        )
    device = torch.device(device)
    kv_cache_dtype = kv_cache_dtype or dtype
    gen = torch.Generator().manual_seed(seed)

    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    pool = torch.tensor(list(block_pool), dtype=torch.long) if block_pool is not None else None
    pool_size = len(pool) if pool is not None else num_blocks
    release = release_out_of_window and sliding_window is not None
    needed = sum(blocks_per_seq) + release
    if needed > pool_size:
        raise ValueError(f"the batch needs {needed} blocks but the pool has {pool_size}")
    chosen = torch.randperm(pool_size, generator=gen)[:needed]
    physical = (pool[chosen] if pool is not None else chosen).tolist()
    if physical and max(physical) >= num_blocks:
        raise ValueError(f"block_pool holds ids >= num_blocks ({num_blocks})")

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    block_tables, key_history, value_history = [], [], []
    prefix_keys, prefix_values, prefix_slots, new_slots = [], [], [], []
    new_keys, new_values = [], []
    cursor = 0
    for q_len, ctx, n_blocks in zip(query_lens, context_lens, blocks_per_seq, strict=True):
        table = physical[cursor : cursor + n_blocks]
        cursor += n_blocks
        cached = ctx - q_len
        released = 0
        if release:
            assert sliding_window is not None
            released = max(0, cached - sliding_window + 1) // block_size
            table[:released] = [physical[-1]] * released
        block_tables.append(table)
        keys, values = randn(ctx, num_kv_heads, head_dim), randn(ctx, num_kv_heads, head_dim)
        key_history.append(keys)
        value_history.append(values)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        kept = released * block_size  # released tokens are never written
        prefix_keys.append(keys[kept:cached])
        prefix_values.append(values[kept:cached])
        prefix_slots += slots[kept:cached]
        new_keys.append(keys[cached:])
        new_values.append(values[cached:])
        new_slots += slots[cached:]

    if release:
        # what another sequence left in the shared block: finite (an FP8 cache holds it) but unrelated
        prefix_keys.append(randn(block_size, num_kv_heads, head_dim) * 8)
        prefix_values.append(randn(block_size, num_kv_heads, head_dim) * 8)
        prefix_slots += [physical[-1] * block_size + i for i in range(block_size)]
    num_tokens = sum(query_lens)
    query = randn(num_tokens, num_heads, head_dim)
    width = max(blocks_per_seq) + extra_table_columns
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)

    def on_device(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    metadata = AttentionMetadata(
        query_start_loc=on_device(torch.tensor(starts, dtype=torch.int32)),
        seq_lens=on_device(torch.tensor(context_lens, dtype=torch.int32)),
        block_tables=on_device(torch.tensor(padded, dtype=torch.int32)),
        slot_mapping=on_device(torch.tensor(new_slots, dtype=torch.int64)),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(context_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
        block_size=block_size,
        scale=head_dim**-0.5 if scale is None else scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
        sinks=on_device(torch.randn(num_heads, generator=gen) * 3.0) if sinks else None,
    )
    return AttentionProblem(
        query=on_device(query),
        key=on_device(torch.cat(new_keys)),
        value=on_device(torch.cat(new_values)),
        key_history=key_history,
        value_history=value_history,
        query_lens=list(query_lens),
        seq_lens=list(context_lens),
        block_tables=block_tables,
        metadata=metadata,
        prefix_key=on_device(torch.cat(prefix_keys)),
        prefix_value=on_device(torch.cat(prefix_values)),
        prefix_slot_mapping=on_device(torch.tensor(prefix_slots, dtype=torch.int64)),
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        device=device,
    )

"""Paged decode attention as an opaque ``torch.library`` custom op, so a compiled decode step can call it.

The step plan (block-id chunks, masks) is built in Python from the context lengths, which a compiler
cannot trace; behind a custom op the rest of each layer compiles around it. The op sees the padded
bucket of :mod:`engine.decode_graphs` (rows after the real ones have context length 0 and slot -1), runs
the backend's normal decode on the real rows and returns zeros for the padding.

Each backend registers its own op (a unique name, holding the backend weakly), so that its plan cache
and gather buffers need no global registry.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_plugin_sdk import AttentionMetadata

if TYPE_CHECKING:
    from engine_plugin_cpu.attention import CpuAttentionBackend

#: torch.library namespace of the ops
OP_NAMESPACE = "engine_cpu"


@dataclass(slots=True)
class CapturedStep:
    """The metadata of the real rows of one padded decode step, reused by every layer of the step.

    Attributes:
        sources: the op's (slot_mapping, seq_lens, block_tables) inputs it was built from.
        snapshot: copies of their contents then: inference tensors keep no version counter, so an
            in-place refill of the same tensors is only seen by comparing contents.
        num_rows: the real (unpadded) rows.
        metadata: decode metadata of those rows; the backend caches its step plan inside.
    """

    sources: tuple[torch.Tensor, ...]
    snapshot: tuple[torch.Tensor, ...]
    num_rows: int
    metadata: AttentionMetadata | None

    def matches(self, tensors: tuple[torch.Tensor, ...]) -> bool:
        return all(a is b for a, b in zip(self.sources, tensors, strict=True)) and all(
            torch.equal(a, b) for a, b in zip(self.snapshot, tensors, strict=True)
        )


def register_decode_op(backend: CpuAttentionBackend) -> Callable[..., torch.Tensor]:
    """A new custom op running ``backend``'s decode attention on a padded bucket; returns the op."""
    ref = weakref.ref(backend)
    name = f"{OP_NAMESPACE}::paged_decode_{uuid.uuid4().hex[:12]}"

    # The KV cache is written in place but deliberately not declared mutated: declaring it makes the
    # compiler functionalize the write (a copy of the whole cache per layer). Only this op reads or
    # writes the cache, and each layer's call depends on the previous layer's output, so the order holds.
    @torch.library.custom_op(name, mutates_args=())
    def paged_decode(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        scale: float,
        sliding_window: int,
        logits_soft_cap: float,
    ) -> torch.Tensor:
        owner = ref()
        if owner is None:
            raise RuntimeError("the attention backend of this compiled step no longer exists")
        step = owner.captured_steps.get(
            slot_mapping, seq_lens, block_tables, block_size, scale, sliding_window, logits_soft_cap
        )
        n = step.num_rows
        if step.metadata is None:
            return torch.zeros_like(query)
        if n == query.shape[0]:
            return owner.forward(query, key, value, kv_cache, step.metadata)
        out = torch.zeros_like(query)
        out[:n] = owner.forward(query[:n], key[:n], value[:n], kv_cache, step.metadata)
        return out

    @paged_decode.register_fake
    def _(query: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.empty_like(query)

    return paged_decode


class CapturedStepCache:
    """The :class:`CapturedStep` of the latest inputs: built on a step's first layer, reused by the rest."""

    def __init__(self) -> None:
        self._step: CapturedStep | None = None

    def get(
        self,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        scale: float,
        sliding_window: int,
        logits_soft_cap: float,
    ) -> CapturedStep:
        if self._step is None or not self._step.matches((slot_mapping, seq_lens, block_tables)):
            self._step = build_captured_step(
                slot_mapping, seq_lens, block_tables, block_size, scale, sliding_window, logits_soft_cap
            )
        return self._step


def call_decode_op(
    op: Callable[..., torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """Run a :func:`register_decode_op` op on a padded bucket's metadata (scalars as the op takes them)."""
    return op(
        query,
        key,
        value,
        kv_cache,
        metadata.slot_mapping,
        metadata.seq_lens,
        metadata.block_tables,
        metadata.block_size,
        float(metadata.scale),
        metadata.sliding_window or 0,
        float(metadata.logits_soft_cap or 0.0),
    )


def build_captured_step(
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int,
    logits_soft_cap: float,
) -> CapturedStep:
    """The real rows (a prefix: padding rows have context length 0) and their decode metadata."""
    sources = (slot_mapping, seq_lens, block_tables)
    snapshot = tuple(t.clone() for t in sources)
    lens = seq_lens.tolist()
    n = next((i for i, length in enumerate(lens) if length <= 0), len(lens))
    if n == 0:
        return CapturedStep(sources, snapshot, 0, None)
    real_lens = lens[:n]
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=seq_lens[:n],
        block_tables=block_tables[:n],
        slot_mapping=slot_mapping[:n],
        query_lens_cpu=[1] * n,
        seq_lens_cpu=real_lens,
        max_query_len=1,
        max_seq_len=max(real_lens),
        block_size=block_size,
        scale=scale,
        sliding_window=sliding_window if sliding_window > 0 else None,
        logits_soft_cap=logits_soft_cap if logits_soft_cap > 0 else None,
    )
    return CapturedStep(sources, snapshot, n, metadata)

"""The attention contract: how a backend lays out the paged KV cache and attends over it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class AttentionMetadata:
    """Everything a backend needs to run one flat batch of mixed prefill, chunked-prefill and decode tokens.

    The batch holds ``num_seqs`` sequences whose new tokens are concatenated into ``num_tokens`` rows.
    Sequence ``i`` contributes rows ``query_start_loc[i]:query_start_loc[i+1]``; those rows are the last
    ``query_len`` positions of a context of ``seq_lens[i]`` tokens, the earlier ones already in the cache.

    Attributes:
        query_start_loc: int32 tensor ``[num_seqs + 1]``, cumulative query lengths, on the device.
        seq_lens: int32 tensor ``[num_seqs]``, total context length per sequence including the new tokens.
        block_tables: int32 tensor ``[num_seqs, max_blocks_per_seq]``; physical block ids, padded with 0.
        slot_mapping: int64 tensor ``[num_tokens]``; the cache slot (``block * block_size + offset``) each
            new token's key and value are written to. A negative slot means "do not write" (padding).
        query_lens_cpu: python list of query lengths (host copy, for backends that loop on the host).
        seq_lens_cpu: python list of context lengths (host copy).
        max_query_len: largest query length in the batch.
        max_seq_len: largest context length in the batch.
        block_size: tokens per KV block.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        causal: whether a query token attends only to positions at or before its own. False (every
            token sees the whole context: encoder models) only for backends whose platform claims
            ``non_causal_attention``, and only in steps where every sequence's query is its whole context
            (``query_lens_cpu == seq_lens_cpu``, nothing cached before the step). Such a step's keys and
            values are never read after it (no decode follows, and its blocks are never prefix-matched),
            so a backend may attend to them from the step's own rows and leave the cache unwritten.
        sliding_window: if set, a query at position p attends only to positions > p - sliding_window
            (causal: key j is visible to query i iff ``i - sliding_window < j <= i``). In a non-causal
            step the window is symmetric: key j is visible to query i iff ``|i - j| < sliding_window``
            (ModernBERT's local layers, whose HF rule ``|i - j| <= local_attention // 2`` is
            ``sliding_window = local_attention // 2 + 1``), and only for backends whose platform claims
            ``non_causal_sliding_window``; others must refuse such a step. Table entries of blocks that
            lie wholly before the window of a sequence's first query are released by the engine and
            point at an unrelated block (its null block): a backend must not let their contents reach
            the output (skip them, or mask them before the softmax and the value product).
        logits_soft_cap: if set, scores become ``cap * tanh(scores / cap)`` before the softmax.
        sinks: if set, float32 ``[num_heads]``: each head's softmax has one more term, ``exp(sinks[h])``,
            in its denominator, with no value (gpt-oss's attention sinks: a head may attend to nothing).
            Set per layer; only for backends whose platform claims ``attention_sinks``.
        extras: free-form, per-step scratch a backend may cache its own plans in; no contract.
        graph_capture: the step is recorded into a graph replayed with other context lengths, so the
            backend must pick launch shapes from the batch alone, never from ``seq_lens_cpu`` /
            ``max_seq_len`` (which then describe the bucket, not the data).
    """

    query_start_loc: Any
    seq_lens: Any
    block_tables: Any
    slot_mapping: Any
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    scale: float
    causal: bool = True
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: Any = None
    extras: dict[str, Any] = field(default_factory=dict)
    graph_capture: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True, slots=True)
class HeadNorm:
    """Per-head RMS norms of the query and key (Qwen3, Gemma 3) for :meth:`AttentionBackend.forward_rotary`
    to apply before it rotates: each head's row ``x`` becomes ``x / sqrt(mean(x^2) + eps) * weight`` in
    float32, rounded to the activations' dtype, as ``ops.rms_norm`` over ``[-1, head_dim]`` rows gives.

    Attributes:
        q_weight: ``[head_dim]``, the query heads' scale (in its applied form).
        k_weight: ``[head_dim]``, the key heads' scale.
        eps: the norms' epsilon.
    """

    q_weight: Any
    k_weight: Any
    eps: float


@dataclass(frozen=True, slots=True)
class RotaryInput:
    """One layer's rotary embedding for :meth:`AttentionBackend.forward_rotary`: rotate-half (NeoX
    layout) over the whole head, the same rotation ``ops.rotary_embedding`` applies.

    Attributes:
        index: int64 ``[num_tokens]``, each new token's row of ``table``.
        table: float32 ``[rows, head_dim]``: a row's ``head_dim / 2`` cosines, then its sines.
        head_norm: the query and key arrive unnormalised too: normalise each head first (only for a
            backend that sets :attr:`AttentionBackend.fuses_head_norm`); None: they arrive normalised.
    """

    index: Any
    table: Any
    head_norm: HeadNorm | None = None


class AttentionBackend(ABC):
    """Paged attention over a block-structured KV cache.

    One instance serves every layer of a model; the per-layer cache tensors are allocated by the
    platform's :class:`BlockCache` with the shape this backend asks for.
    """

    #: block sizes (tokens per block) this backend runs
    supported_block_sizes: tuple[int, ...] = (16,)
    #: head dimensions this backend runs
    supported_head_sizes: tuple[int, ...] = (64, 128)
    #: whether :meth:`forward_rotary` runs (the core rotates queries and keys itself otherwise)
    fuses_rotary: bool = False
    #: whether :meth:`forward_rotary` also takes per-head q/k norms (``RotaryInput.head_norm``): a decode
    #: kernel that holds each head's row anyway saves the two norm launches of a layer
    fuses_head_norm: bool = False

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's KV cache tensor (keys and values together).

        Args:
            num_blocks: physical blocks in the pool.
            block_size: tokens per block.
            num_kv_heads: key/value heads.
            head_dim: size of one head.

        Returns:
            The tensor shape; its element count must be ``2 * num_blocks * block_size * num_kv_heads *
            head_dim`` (plus any padding the backend documents).
        """

    @abstractmethod
    def write_kv(self, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> Any:
        """Store new keys and values into the cache.

        Args:
            key: ``[num_tokens, num_kv_heads, head_dim]``.
            value: ``[num_tokens, num_kv_heads, head_dim]``.
            kv_cache: one layer's cache, as shaped by :meth:`kv_cache_shape`.
            slot_mapping: int64 ``[num_tokens]``; negative slots are skipped.

        Returns:
            The cache holding the new entries. Backends that write in place return None (or ``kv_cache``);
            backends over immutable arrays (JAX) return a new array, and callers must keep it in place of
            ``kv_cache``.
        """

    @abstractmethod
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        """Write ``key``/``value`` into the cache, then attend every query over its sequence's context.

        Args:
            query: ``[num_tokens, num_heads, head_dim]``.
            key: ``[num_tokens, num_kv_heads, head_dim]`` for the new tokens.
            value: ``[num_tokens, num_kv_heads, head_dim]`` for the new tokens.
            kv_cache: one layer's cache.
            metadata: the batch description, shared by all layers of a step.

        Returns:
            ``[num_tokens, num_heads, head_dim]`` attention output in the query's dtype.

        Raises:
            ValueError: if the metadata uses a feature this backend does not claim.
        """

    def forward_rotary(
        self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata, rotary: RotaryInput
    ) -> Any:
        """:meth:`forward` for an unrotated query and key: rotate both by ``rotary`` first (the key is
        cached rotated). A backend fuses the rotation into its attention where that saves a launch (a
        decode kernel that loads the query and stores the key anyway); the core calls this only when
        :attr:`fuses_rotary` is set, and only for a rotary over the whole head.

        Args:
            query, key, value, kv_cache, metadata: as for :meth:`forward`; ``query`` and ``key`` may be
                rotated in place.
            rotary: the layer's rotation, and with ``rotary.head_norm`` the per-head norms to apply
                to the query and key before it.

        Returns:
            As :meth:`forward`.

        Raises:
            ValueError: as :meth:`forward`, for a backend without :attr:`fuses_rotary`, or for a
                ``head_norm`` given to one without :attr:`fuses_head_norm`.
        """
        raise ValueError(f"{type(self).__name__} does not fuse the rotary embedding into attention")

    def gather_kv(self, kv_cache: Any, block_ids: list[int]) -> tuple[Any, Any]:
        """Return keys and values ``[len(block_ids) * block_size, num_kv_heads, head_dim]`` of some blocks.

        Optional; the conformance suite uses it to check cache writes. The default raises.
        """
        raise NotImplementedError

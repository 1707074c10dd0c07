"""The optional whole-forward contract: a platform that runs the model itself instead of the core's torch model.

Most platforms plug kernels into the core's torch model (attention, GEMM, ops). A platform whose arrays
are not torch tensors (JAX, whose arrays are immutable and whose programs are compiled whole) cannot do
that efficiently, so it may return a :class:`PlatformModelRunner` from
:meth:`engine.interfaces.platform.Platform.make_model_runner`. The core then hands it each step as host
data (:class:`FlatStep`) and gets back float32 logits for the rows that sample; scheduling, block tables,
sampling and detokenizing stay in the core.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.interfaces.block_cache import BlockCache


@dataclass(slots=True)
class FlatStep:
    """One step's flat batch of new tokens, as host numpy arrays (no device or torch types).

    The fields mean what they mean in :class:`engine.interfaces.attention.AttentionMetadata`.

    Attributes:
        token_ids: int64 ``[num_tokens]``.
        positions: int64 ``[num_tokens]``, each token's position in its sequence.
        slot_mapping: int64 ``[num_tokens]``, the cache slot each token's key and value go to.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, padded with 0.
        query_start_loc: int32 ``[num_seqs + 1]``, cumulative new-token counts.
        seq_lens: int32 ``[num_seqs]``, context length per sequence including the new tokens.
        logits_indices: int64 ``[num_sampled]``, the token rows whose logits are wanted, in order.
        block_size: tokens per KV block.
        sliding_window: the model's attention window, or None.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    logits_indices: np.ndarray
    block_size: int
    sliding_window: int | None = None

    @classmethod
    def from_step_tensors(cls, input_ids: Any, positions: Any, metadata: Any, logits_indices: Any) -> FlatStep:
        """Build from the core runner's step tensors (host tensors; converted without copies where possible).

        Args:
            input_ids: ``[num_tokens]`` token ids.
            positions: ``[num_tokens]`` positions.
            metadata: the step's :class:`engine.interfaces.attention.AttentionMetadata`.
            logits_indices: ``[num_sampled]`` rows whose logits are wanted.
        """

        def host(x: Any, dtype: Any) -> np.ndarray:
            return np.asarray(x.cpu() if hasattr(x, "cpu") else x).astype(dtype, copy=False)

        return cls(
            token_ids=host(input_ids, np.int64),
            positions=host(positions, np.int64),
            slot_mapping=host(metadata.slot_mapping, np.int64),
            block_tables=host(metadata.block_tables, np.int32),
            query_start_loc=host(metadata.query_start_loc, np.int32),
            seq_lens=host(metadata.seq_lens, np.int32),
            logits_indices=host(logits_indices, np.int64),
            block_size=metadata.block_size,
            sliding_window=metadata.sliding_window,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class PlatformModelRunner(ABC):
    """Loads a model's weights onto the device and runs whole forward steps over the paged KV cache.

    Attributes:
        scale: the attention softmax scale (``head_dim ** -0.5`` for the Llama family); the core records it
            in the step's attention metadata.
    """

    scale: float

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Take the loader's HF-named CPU tensors once and keep them in the device's own format.

        Args:
            weights: ``(name, tensor)`` pairs as :func:`engine.loader.iter_weights` yields them.

        Raises:
            ValueError: if a tensor the architecture needs is missing or has the wrong shape.
        """

    @abstractmethod
    def compute_logits(self, step: FlatStep, block_cache: BlockCache) -> Any:
        """Run one forward step: write the new tokens' keys and values into ``block_cache``, attend, and
        return the logits of the rows in ``step.logits_indices``.

        The step must run even when ``logits_indices`` is empty (a chunk of a prefill writes its cache).

        Args:
            step: the batch.
            block_cache: the pool the platform's :meth:`~engine.interfaces.platform.Platform.make_block_cache`
                built; a runner over immutable arrays stores the updated per-layer caches back into
                ``block_cache.kv_caches``.

        Returns:
            A float32 torch CPU tensor ``[len(step.logits_indices), vocab_size]`` for the core's sampler.
        """

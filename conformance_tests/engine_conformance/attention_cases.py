"""The batches and features of the attention coverage matrix (``test_attention_matrix.py``), as data.

Every batch is written in units of the block size, so that whichever block size a cell runs with, its
contexts land on the same places relative to block edges: shorter than one block, exactly one and two
blocks, and a few tokens past a multiple. Windows are likewise placed relative to the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

#: a batch as ``[(query_len, context_len), ...]``, one pair per sequence
Batch = list[tuple[int, int]]

SHAPES = ("decode", "prefill", "chunked", "mixed")
FEATURES = ("plain", "window", "window_released", "soft_cap", "gqa", "mqa", "scale")
SOFT_CAP = 1.5


def batch(shape: str, block_size: int) -> Batch:
    """The matrix's batch of one shape, for block size ``block_size``.

    Args:
        shape: ``"decode"`` (one new token each), ``"prefill"`` (the whole context is new), ``"chunked"``
            (a chunk of a prompt over a cached prefix) or ``"mixed"`` (decode rows first, then chunks and
            a prefill, as the scheduler orders a continuous-batching step).
        block_size: tokens per KV block.

    Raises:
        ValueError: for an unknown shape.
    """
    bs = block_size
    half = bs // 2 + 1  # inside one block: the partially filled last block with nothing before it
    if shape == "decode":
        return [(1, 1), (1, half), (1, bs), (1, 2 * bs), (1, 3 * bs + 3)]
    if shape == "prefill":
        return [(1, 1), (half, half), (bs, bs), (2 * bs + 3, 2 * bs + 3)]
    if shape == "chunked":
        # a chunk inside one block, one that starts on a block edge and fills it, and one that straddles
        # two blocks over a prefix long enough for a two-block window to release a whole block
        return [(5, bs + 5), (bs, 2 * bs), (bs, 4 * bs + 2)]
    if shape == "mixed":
        return [(1, 2 * bs), (1, 3 * bs + 3), (1, half), (7, 3 * bs), (half, half), (1, bs + 1)]
    raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")


@dataclass(frozen=True, slots=True)
class FeatureSetup:
    """How one matrix feature sets up a problem.

    Attributes:
        num_heads, num_kv_heads: the head layout: two heads each by default (few, so the matrix also runs
            in an interpreter), GQA with a group of 3, which is not a power of two, so a kernel that pads
            its group of query heads is exercised; MQA with one KV head.
        sliding_window: the window in tokens, or None.
        release_out_of_window: point the table entries of blocks wholly out of the window at a shared
            block of unrelated values, as the engine does once it released them.
        soft_cap: the logit soft-cap, or None.
        scale_factor: the softmax scale as a multiple of ``head_dim ** -0.5`` (1.0: the default).
        claim: the :class:`Capabilities` flag that must be set for the feature, or ``""``.
    """

    num_heads: int = 2
    num_kv_heads: int = 2
    sliding_window: int | None = None
    release_out_of_window: bool = False
    soft_cap: float | None = None
    scale_factor: float = 1.0
    claim: str = ""


def feature_setup(feature: str, block_size: int) -> FeatureSetup:
    """The setup of ``feature`` for block size ``block_size``.

    The plain window ends mid-block (1.5 blocks + 1: contexts of the matrix fall both inside and beyond it);
    the released-blocks window is exactly two blocks, so its edge sits on a block boundary (the off-by-one
    a kernel that skips whole blocks gets wrong) and the longest contexts have whole blocks released.

    Raises:
        ValueError: for an unknown feature.
    """
    if feature == "plain":
        return FeatureSetup()
    if feature == "window":
        return FeatureSetup(sliding_window=block_size + block_size // 2 + 1, claim="sliding_window")
    if feature == "window_released":
        return FeatureSetup(sliding_window=2 * block_size, release_out_of_window=True, claim="sliding_window")
    if feature == "soft_cap":
        return FeatureSetup(soft_cap=SOFT_CAP, claim="logits_soft_cap")
    if feature == "gqa":
        return FeatureSetup(num_heads=6, num_kv_heads=2)
    if feature == "mqa":
        return FeatureSetup(num_heads=4, num_kv_heads=1)
    if feature == "scale":
        # not head_dim**-0.5 (Gemma-style query_pre_attn_scalar): a backend that recomputes the default
        # instead of reading metadata.scale gets visibly different probabilities
        return FeatureSetup(scale_factor=2**0.5)
    raise ValueError(f"unknown feature {feature!r}; known: {FEATURES}")


def blocks_needed(cells: Batch, block_size: int, release: bool) -> int:
    """Physical blocks the batch occupies (plus the shared block released entries point at)."""
    return sum(-(-ctx // block_size) for _, ctx in cells) + int(release)

"""Attention at sizes that reach the code paths short batches never do.

Kernels change strategy with size: a prefill tiles its queries (64 or 128 rows a tile, so 65 and 300
tokens cross tile edges), a chunk of a prompt over a long cached prefix iterates over many key tiles, and
a decode splits a long context across programs (flash-decoding: split counts change at multiples of
128-512 keys, so 513, 1025 and ~4100 keys give partial last splits and, under a window, empty splits
whose partial results must get no weight). Host backends chunk keys by a budget of blocks (4100 keys
cross it at block size 16). Each batch here is chosen for the path it reaches, not its volume, so that
the rows also run in an interpreter.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import (
    check_unclaimed_attention_feature,
    default_geometry,
    run_attention_problem,
)
from engine_plugin_sdk.problems import AttentionProblem, make_attention_problem

#: (query_len, context_len) per sequence
LONG_PREFILL = [(65, 65), (300, 300), (129, 129)]
#: chunks over 128 tokens on cached prefixes over 256 tokens (one prefix a block multiple, one not)
LONG_CHUNKS = [(129, 129 + 257), (200, 200 + 320)]
#: contexts one past the usual split / chunk thresholds
LONG_DECODE = [(1, 513), (1, 1025), (1, 4100), (1, 7)]
#: long decode rows first, then a long chunk and a fresh prefill, as one continuous-batching step
LONG_MIXED = [(1, 1025), (1, 513), (150, 420), (70, 70)]
WINDOW = 300


def build_long(
    caps: Capabilities, device: Any, cells: list[tuple[int, int]], seed: int, **overrides: Any
) -> AttentionProblem:
    """A problem over ``cells`` in the default geometry, with GQA (2 query heads over 1 KV head).

    Few heads: the work a kernel does per key tile is what the length tests, and every head more is
    another pass over all the keys in an interpreter.
    """
    geo = default_geometry(caps)
    query_lens, context_lens = [q for q, _ in cells], [c for _, c in cells]
    blocks = sum(-(-c // geo.block_size) for c in context_lens)
    # a few spare blocks of garbage (a wrong block lookup reads them) without a large random fill
    return make_attention_problem(
        len(cells), query_lens, context_lens, 2, 1, geo.head_size, geo.block_size, blocks + 16,
        dtype=geo.dtype, device=device, seed=seed, **overrides,
    )  # fmt: skip


@pytest.mark.capability("attention.long.prefill")
def test_long_prefill(platform: Platform, caps: Capabilities, device: Any) -> None:
    problem = build_long(caps, device, LONG_PREFILL, seed=40)
    run_attention_problem(platform, problem, "attention.long.prefill", f"(query, context) {LONG_PREFILL}")


@pytest.mark.capability("attention.long.chunked_prefill")
def test_long_chunks_over_long_prefixes(platform: Platform, caps: Capabilities, device: Any) -> None:
    problem = build_long(caps, device, LONG_CHUNKS, seed=41)
    run_attention_problem(
        platform, problem, "attention.long.chunked_prefill", f"(query, context) {LONG_CHUNKS}"
    )


@pytest.mark.capability("attention.long.decode")
def test_long_decode_contexts(platform: Platform, caps: Capabilities, device: Any) -> None:
    problem = build_long(caps, device, LONG_DECODE, seed=42)
    run_attention_problem(platform, problem, "attention.long.decode", f"(query, context) {LONG_DECODE}")


@pytest.mark.capability("attention.long.mixed")
def test_long_mixed_batch(platform: Platform, caps: Capabilities, device: Any) -> None:
    problem = build_long(caps, device, LONG_MIXED, seed=43)
    run_attention_problem(platform, problem, "attention.long.mixed", f"(query, context) {LONG_MIXED}")


@pytest.mark.capability("attention.long.decode_window")
def test_long_decode_under_a_window(
    platform: Platform, caps: Capabilities, device: Any, record_property: Any
) -> None:
    """A window much shorter than the context, with the out-of-window blocks released: most of a split
    decode's programs see no key at all, and the released table entries point at unrelated values."""
    problem = build_long(
        caps, device, LONG_DECODE, seed=44, sliding_window=WINDOW, release_out_of_window=True
    )
    if not caps.sliding_window:
        check_unclaimed_attention_feature(platform, problem, "attention.long.decode_window", record_property)
        return
    context = f"(query, context) {LONG_DECODE}, window {WINDOW}"
    run_attention_problem(platform, problem, "attention.long.decode_window", context)

"""The attention coverage matrix: every claimed (dtype, KV cache dtype) pair x batch shape x feature.

Each cell is its own capability, ``attention.matrix.<dtype>.<kv_cache_dtype>.<shape>.<feature>``, so that
the report shows the whole matrix (the runner draws it as one table: rows shape x feature, columns
dtype / KV cache dtype) and a vendor sees at a glance which combination breaks. Shapes and features are
described in :mod:`engine_conformance.attention_cases`.

Head sizes and block sizes come from the claims: the cells rotate through the claimed head sizes and
block sizes (a cell's position in the matrix picks them), so that every claimed size meets several
shapes and features without multiplying the matrix by them; a failure message names the geometry.
The batches are small on purpose (they reach code paths, not volume); the long contexts that cross
split and chunk thresholds are in ``test_attention_long.py``.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.attention_cases import FEATURES, SHAPES, batch, blocks_needed, feature_setup
from engine_conformance.helpers import check_unclaimed_attention_feature, run_attention_problem, torch_dtype
from engine_conformance.pytest_plugin import not_claimed
from engine_plugin_sdk.problems import AttentionProblem, make_attention_problem

CAPABILITY = "attention.matrix.{dtype_name}.{kv_cache_dtype_name}.{shape}.{feature}"


def column_index(caps: Capabilities, dtype_name: str, kv_cache_dtype_name: str) -> int:
    """The position of the (dtype, KV cache dtype) column among all claimed pairs."""
    pairs = list(itertools.product(caps.dtypes, caps.kv_cache_dtypes))
    return pairs.index((dtype_name, kv_cache_dtype_name))


def pair_rejection(platform: Platform, dtype_name: str, kv_cache_dtype_name: str, block_size: int) -> str:
    """Why the platform's own ``validate`` refuses this dtype with this cache dtype, or ``""``.

    Claiming both dtypes need not mean claiming every pairing (a backend may require the cache in the
    model dtype); ``validate`` is where a platform says so, and the engine would refuse the same config.
    """
    config = EngineConfig(
        dtype=dtype_name, cache=CacheConfig(kv_cache_dtype=kv_cache_dtype_name, block_size=block_size)
    )
    return "; ".join(platform.validate(config))


def build_cell(
    caps: Capabilities, device: Any, dtype_name: str, kv_cache_dtype_name: str, shape: str, feature: str
) -> tuple[AttentionProblem, str]:
    """The cell's problem and a description of its geometry for failure messages."""
    # the cell's position rotates the claimed head and block sizes; one step per column as well, so that
    # each size also meets every dtype pair
    position = (
        SHAPES.index(shape) * len(FEATURES)
        + FEATURES.index(feature)
        + column_index(caps, dtype_name, kv_cache_dtype_name)
    )
    head_dim = caps.head_sizes[position % len(caps.head_sizes)]
    block_size = caps.block_sizes[position % len(caps.block_sizes)]
    setup = feature_setup(feature, block_size)
    cells = batch(shape, block_size)
    query_lens, context_lens = [q for q, _ in cells], [c for _, c in cells]
    # twice the blocks in use: the rest of the pool holds garbage that a wrong block lookup would read
    num_blocks = 2 * blocks_needed(cells, block_size, setup.release_out_of_window) + 3
    problem = make_attention_problem(
        len(cells), query_lens, context_lens, setup.num_heads, setup.num_kv_heads, head_dim, block_size,
        num_blocks, dtype=torch_dtype(dtype_name), device=device, seed=1000 + position,
        sliding_window=setup.sliding_window, soft_cap=setup.soft_cap,
        kv_cache_dtype=torch_dtype(kv_cache_dtype_name), release_out_of_window=setup.release_out_of_window,
        scale=setup.scale_factor * head_dim**-0.5,
    )  # fmt: skip
    geometry = (
        f"head_dim {head_dim}, block {block_size}, heads {setup.num_heads}/{setup.num_kv_heads}, "
        f"(query, context) {cells}, window {setup.sliding_window}, soft_cap {setup.soft_cap}, "
        f"scale {problem.metadata.scale:.4g}"
    )
    return problem, geometry


@pytest.mark.capability(CAPABILITY)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_matrix(
    platform: Platform,
    caps: Capabilities,
    device: Any,
    dtype_name: str,
    kv_cache_dtype_name: str,
    shape: str,
    feature: str,
    record_property: Any,
) -> None:
    capability = CAPABILITY.format(
        dtype_name=dtype_name, kv_cache_dtype_name=kv_cache_dtype_name, shape=shape, feature=feature
    )
    problem, geometry = build_cell(caps, device, dtype_name, kv_cache_dtype_name, shape, feature)
    refused = pair_rejection(platform, dtype_name, kv_cache_dtype_name, problem.block_size)
    if refused:
        not_claimed(f"dtype {dtype_name} with KV cache {kv_cache_dtype_name}: {refused}")
    claim = feature_setup(feature, problem.block_size).claim
    if claim and not getattr(caps, claim):
        # an unclaimed feature is reported "not claimed" only once the backend is seen to refuse it
        check_unclaimed_attention_feature(platform, problem, capability, record_property)
        return
    run_attention_problem(platform, problem, capability, geometry)

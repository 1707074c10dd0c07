"""Paged attention against the float64 reference: decode, prefill, chunked prefill, GQA/MQA, every claimed
head size, block size and dtype, sliding window (with released blocks), soft-cap, sinks, non-causal (encoder)
steps. The coverage matrix, the long contexts and the offsets beyond 32 bits have modules of their own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import (
    check_unclaimed_attention_feature,
    default_geometry,
    run_attention_problem,
    torch_dtype,
)
from engine_conformance.pytest_plugin import not_claimed
from engine_plugin_sdk.problems import AttentionProblem, make_attention_problem
from engine_plugin_sdk.tolerances import compare

NUM_BLOCKS = 512
# (query_lens, context_lens) batches; every one mixes lengths that are not multiples of a block
DECODE = ([1, 1, 1, 1, 1], [1, 17, 33, 64, 100])
PREFILL = ([1, 7, 16, 31], [1, 7, 16, 31])
MIXED = ([5, 1, 16, 1, 9], [37, 50, 16, 3, 73])
#: a continuous-batching step as the scheduler orders it: running decodes first, then prompt chunks (one of
#: them a single token, which is not a decode row of the leading run)
DECODE_ROWS_FIRST = ([1, 1, 1, 1, 7, 1, 12], [40, 9, 77, 33, 7, 30, 60])
#: a speculative verification step: each sequence's last token and up to 7 proposals over a cached context
#: (a GPU backend may run such rows as one decode row per token), with the sliding-window variant's context
#: longer than its window
SHORT_ROWS = ([5, 1, 3, 8, 2], [40, 9, 77, 33, 100])
#: a lone prompt chunk over a cached prefix, recorded in a bucket of 64 rows (the engine's prompt graphs)
RECORDED_CHUNK = ([37], [100])
RECORDED_BUCKET = 64
#: an encoder step: whole prompts, nothing cached. A one-token prompt (which a backend may run as a decode
#: row), prompts within a block and over several, two of one length (batched prefill paths group those), and
#: one longer than the widest query tile of the GPU tunings (128 rows), so that a tile's rows must see keys
#: beyond the tile's own
NON_CAUSAL = ([1, 7, 33, 7, 150], [1, 7, 33, 7, 150])


def build(
    caps: Capabilities,
    device: Any,
    lens: tuple[list[int], list[int]],
    num_heads: int = 8,
    num_kv_heads: int = 2,
    seed: int = 0,
    **overrides: Any,
) -> AttentionProblem:
    geo = default_geometry(caps)
    args: dict[str, Any] = {
        "head_dim": geo.head_size,
        "block_size": geo.block_size,
        "dtype": geo.dtype,
        "num_blocks": NUM_BLOCKS,
    }
    args.update(overrides)
    query_lens, context_lens = lens
    return make_attention_problem(
        len(query_lens), query_lens, context_lens, num_heads, num_kv_heads, device=device, seed=seed, **args
    )


@pytest.mark.capability("attention.decode")
def test_decode(platform: Platform, caps: Capabilities, device: Any) -> None:
    run_attention_problem(platform, build(caps, device, DECODE, num_kv_heads=8, seed=1), "attention.decode")


@pytest.mark.capability("attention.prefill")
def test_prefill(platform: Platform, caps: Capabilities, device: Any) -> None:
    run_attention_problem(platform, build(caps, device, PREFILL, num_kv_heads=8, seed=2), "attention.prefill")


@pytest.mark.capability("attention.chunked_prefill")
def test_chunked_prefill_mixed_with_decode(platform: Platform, caps: Capabilities, device: Any) -> None:
    run_attention_problem(platform, build(caps, device, MIXED, num_kv_heads=8, seed=3), "attention.chunked_prefill")


@pytest.mark.capability("attention.decode_rows_first")
def test_decode_rows_ahead_of_prefill_chunks(platform: Platform, caps: Capabilities, device: Any) -> None:
    problem = build(caps, device, DECODE_ROWS_FIRST, num_heads=8, num_kv_heads=2, seed=12)
    run_attention_problem(platform, problem, "attention.decode_rows_first")


@pytest.mark.capability("attention.short_rows")
def test_short_rows_over_cached_contexts(platform: Platform, caps: Capabilities, device: Any) -> None:
    """Rows of 1 to 8 new tokens over cached contexts (speculative verification), with GQA, and under a
    sliding window where one is claimed: each new token sees its own context, the earlier new ones included.
    Each step runs eagerly, and as a step recorded into a graph where the platform claims recording such
    steps (``graph_capture_verify``: a backend may then take another path, its launch shapes fixed by the
    batch alone)."""
    problems = [build(caps, device, SHORT_ROWS, num_heads=8, num_kv_heads=2, seed=16)]
    if caps.sliding_window:
        problems.append(build(caps, device, SHORT_ROWS, num_heads=8, num_kv_heads=2, seed=17, sliding_window=6))
    for problem in problems:
        window = problem.metadata.sliding_window
        for recorded in (False, True)[: 1 + caps.graph_capture_verify]:
            problem.metadata.graph_capture = recorded
            context = ", ".join([f"window {window}"] * bool(window) + ["recorded"] * recorded)
            run_attention_problem(platform, problem, "attention.short_rows", context)


@pytest.mark.capability("attention.recorded_prefill")
def test_recorded_prompt_chunk(platform: Platform, caps: Capabilities, device: Any) -> None:
    """One sequence's prompt chunk as the engine records it (``graph_capture_prefill``, :mod:`engine.prefill_graphs`):
    padded to a bucket of ``RECORDED_BUCKET`` rows whose padding writes nowhere (slot -1) and extends the
    context, the host lists describing the bucket rather than the data. The chunk's own rows must match the
    float64 reference, whatever the cache holds past them (the problem's cache is random)."""
    if not caps.graph_capture_prefill:
        not_claimed("recorded prompt chunks (graph_capture_prefill) are not claimed")
    problems = [build(caps, device, RECORDED_CHUNK, num_heads=8, num_kv_heads=2, seed=18)]
    if caps.sliding_window:
        problems.append(build(caps, device, RECORDED_CHUNK, num_heads=8, num_kv_heads=2, seed=19, sliding_window=9))
    for problem in problems:
        backend = platform.make_attention_backend()
        cache = problem.allocate_cache(backend)
        problem.fill_cache(backend, cache)
        query, key, value, metadata = recorded_chunk(problem, RECORDED_BUCKET, max_model_len=NUM_BLOCKS)
        out = backend.forward(query, key, value, cache, metadata)[: problem.query.shape[0]]
        mismatch = compare(out, problem.reference_output(), problem.tolerance(), "attention.recorded_prefill")
        if mismatch:
            pytest.fail(f"{mismatch} [window {problem.metadata.sliding_window}]", pytrace=False)


def recorded_chunk(
    problem: AttentionProblem, bucket: int, max_model_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``problem``'s single chunk padded to ``bucket`` rows as :class:`engine.prefill_graphs.PrefillGraphs`
    records it: random padding rows, slot -1, the context counting them, the block table widened with
    zeros to ``max_model_len`` (block 0 then stands for the padding's keys), host lists of the bucket."""
    md = problem.metadata
    q = problem.query.shape[0]
    pad = bucket - q
    gen = torch.Generator().manual_seed(bucket)

    def padded(t: torch.Tensor) -> torch.Tensor:
        extra = torch.randn((pad, *t.shape[1:]), generator=gen).to(device=t.device, dtype=t.dtype)
        return torch.cat((t, extra))

    width = -(-max_model_len // md.block_size)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, bucket], dtype=torch.int32, device=problem.device),
        seq_lens=md.seq_lens + pad,
        block_tables=F.pad(md.block_tables, (0, width - md.block_tables.shape[1])),
        slot_mapping=F.pad(md.slot_mapping, (0, pad), value=-1),
        query_lens_cpu=[bucket],
        seq_lens_cpu=[max_model_len],
        max_query_len=bucket,
        max_seq_len=max_model_len,
        block_size=md.block_size,
        scale=md.scale,
        sliding_window=md.sliding_window,
        graph_capture=True,
    )
    return padded(problem.query), padded(problem.key), padded(problem.value), metadata


@pytest.mark.capability("attention.gqa")
def test_grouped_query_attention(platform: Platform, caps: Capabilities, device: Any) -> None:
    run_attention_problem(platform, build(caps, device, MIXED, num_heads=8, num_kv_heads=2, seed=4), "attention.gqa")


@pytest.mark.capability("attention.mqa")
def test_multi_query_attention(platform: Platform, caps: Capabilities, device: Any) -> None:
    run_attention_problem(platform, build(caps, device, MIXED, num_heads=4, num_kv_heads=1, seed=5), "attention.mqa")


@pytest.mark.capability("attention.head_size.{head_size}")
def test_head_size(platform: Platform, caps: Capabilities, device: Any, head_size: int) -> None:
    if head_size not in caps.head_sizes:
        not_claimed(f"head size {head_size} (claimed: {list(caps.head_sizes)})")
    problem = build(caps, device, MIXED, num_heads=4, num_kv_heads=2, seed=6, head_dim=head_size)
    run_attention_problem(platform, problem, f"attention.head_size.{head_size}")


@pytest.mark.capability("attention.block_size.{block_size}")
def test_block_size(platform: Platform, caps: Capabilities, device: Any, block_size: int) -> None:
    problem = build(caps, device, MIXED, seed=7, block_size=block_size)
    run_attention_problem(platform, problem, f"attention.block_size.{block_size}")


@pytest.mark.capability("attention.dtype.{dtype_name}")
def test_dtype(platform: Platform, caps: Capabilities, device: Any, dtype_name: str) -> None:
    problem = build(caps, device, MIXED, seed=8, dtype=torch_dtype(dtype_name))
    run_attention_problem(platform, problem, f"attention.dtype.{dtype_name}")


@pytest.mark.capability("attention.kv_cache_dtype.{kv_cache_dtype_name}")
def test_kv_cache_dtype(
    platform: Platform, caps: Capabilities, device: Any, kv_cache_dtype_name: str
) -> None:
    kv = torch_dtype(kv_cache_dtype_name)
    # a cache as wide as a claimed model dtype runs with that dtype; a narrower one under the default dtype
    dtype = kv if kv_cache_dtype_name in caps.dtypes else default_geometry(caps).dtype
    problem = build(caps, device, MIXED, seed=9, dtype=dtype, kv_cache_dtype=kv)
    run_attention_problem(platform, problem, f"attention.kv_cache_dtype.{kv_cache_dtype_name}")


@pytest.mark.capability("attention.sliding_window")
def test_sliding_window(platform: Platform, caps: Capabilities, device: Any, record_property: Any) -> None:
    problem = build(caps, device, MIXED, seed=10, sliding_window=8)
    if not caps.sliding_window:
        check_unclaimed_attention_feature(platform, problem, "attention.sliding_window", record_property)
        return
    run_attention_problem(platform, problem, "attention.sliding_window")


@pytest.mark.capability("attention.sliding_window.released_blocks")
def test_sliding_window_with_released_blocks(platform: Platform, caps: Capabilities, device: Any) -> None:
    """Blocks that fell out of the window are released by the engine and their table entries point at a
    block holding someone else's keys: no backend may let them change the output."""
    if not caps.sliding_window:
        not_claimed("sliding windows are not claimed")
    for lens, seed in ((MIXED, 13), (DECODE, 14), (DECODE_ROWS_FIRST, 15)):
        problem = build(caps, device, lens, seed=seed, sliding_window=8, release_out_of_window=True)
        run_attention_problem(platform, problem, "attention.sliding_window.released_blocks")


@pytest.mark.capability("attention.logits_soft_cap")
def test_logits_soft_cap(platform: Platform, caps: Capabilities, device: Any, record_property: Any) -> None:
    problem = build(caps, device, MIXED, seed=11, soft_cap=1.5)
    if not caps.logits_soft_cap:
        check_unclaimed_attention_feature(platform, problem, "attention.logits_soft_cap", record_property)
        return
    run_attention_problem(platform, problem, "attention.logits_soft_cap")


@pytest.mark.capability("attention.sinks")
def test_attention_sinks(platform: Platform, caps: Capabilities, device: Any, record_property: Any) -> None:
    """gpt-oss's sinks (``metadata.sinks``: one more softmax term per head, no value), random per head, on a
    decode batch (which a backend may split across programs: the sink must count once), a prefill and chunks,
    a mixed batch, and a mixed batch under a sliding window."""
    cases = [(DECODE, {}), (PREFILL, {}), (MIXED, {}), (MIXED, {"sliding_window": 12})]
    problems = [build(caps, device, lens, seed=40 + i, sinks=True, **extra) for i, (lens, extra) in enumerate(cases)]
    if not caps.attention_sinks:
        check_unclaimed_attention_feature(platform, problems[0], "attention.sinks", record_property)
        return
    if not caps.sliding_window:
        problems = problems[:3]
    for problem in problems:
        run_attention_problem(platform, problem, "attention.sinks")


@pytest.mark.capability("attention.non_causal")
def test_non_causal_attention(
    platform: Platform, caps: Capabilities, device: Any, record_property: Any
) -> None:
    """Encoder attention (``metadata.causal=False``: every token sees its whole prompt, later tokens
    included) on a step of whole prompts of several lengths with GQA, in every claimed model dtype, and
    with the logit soft-cap where that is claimed too (it moves some backends off their plain SDPA path
    onto a masked one). A platform that does not claim it must refuse such a step."""
    default = default_geometry(caps).dtype
    dtypes = [default, *(d for d in map(torch_dtype, caps.dtypes) if d != default)]
    problems = [
        build(caps, device, NON_CAUSAL, num_heads=8, num_kv_heads=2, seed=50 + i, dtype=dtype, causal=False)
        for i, dtype in enumerate(dtypes)
    ]
    if not caps.non_causal_attention:
        check_unclaimed_attention_feature(platform, problems[0], "attention.non_causal", record_property)
        return
    if caps.logits_soft_cap:
        problems.append(build(caps, device, NON_CAUSAL, seed=60, soft_cap=1.5, causal=False))
    for problem in problems:
        dtype_name = str(problem.dtype).removeprefix("torch.")
        run_attention_problem(platform, problem, "attention.non_causal", f"dtype {dtype_name}")


@pytest.mark.capability("attention.non_causal.sliding_window")
def test_non_causal_sliding_window(
    platform: Platform, caps: Capabilities, device: Any, record_property: Any
) -> None:
    """ModernBERT's local layers: a non-causal step under a symmetric window (key j visible to query i iff
    ``|i - j| < sliding_window``) on the encoder batch, in every claimed model dtype: prompts within the
    window (which then sees everything), and longer ones, down to keys past a 128-row query tile's last row
    (the window of 9 is HF's ``local_attention=16``; one of 70 crosses blocks and tiles both ways). A platform
    that claims non-causal attention but not this must refuse it rather than run the window one-sided."""
    default = default_geometry(caps).dtype
    dtypes = [default, *(d for d in map(torch_dtype, caps.dtypes) if d != default)]
    problems = [
        build(caps, device, NON_CAUSAL, seed=70 + i, dtype=dtype, causal=False, sliding_window=9)
        for i, dtype in enumerate(dtypes)
    ]
    if not (caps.non_causal_attention and caps.non_causal_sliding_window):
        check_unclaimed_attention_feature(platform, problems[0], "attention.non_causal.sliding_window", record_property)
        return
    problems.append(build(caps, device, NON_CAUSAL, num_kv_heads=8, seed=79, causal=False, sliding_window=70))
    for problem in problems:
        name = f"dtype {str(problem.dtype).removeprefix('torch.')}, window {problem.metadata.sliding_window}"
        run_attention_problem(platform, problem, "attention.non_causal.sliding_window", name)

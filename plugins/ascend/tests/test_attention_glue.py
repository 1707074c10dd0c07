"""Layout, step planning and the arguments the attention backend hands to the kernels (on the CPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine_plugin_ascend import reference_kernels
from engine_plugin_ascend.attention import PLAN_KEY, AscendAttentionBackend
from engine_plugin_ascend.attention_plan import build_step_plan
from engine_plugin_ascend.layout import (
    as_page_attention_kv,
    causal_mask,
    check_geometry,
    kv_cache_shape,
    split_caches,
)
from engine_plugin_sdk import AttentionMetadata
from engine_plugin_sdk.problems import make_attention_problem
from engine_plugin_sdk.tolerances import compare

# (query_lens, context_lens): decode rows interleaved with a fresh prefill and two chunked prefills
MIXED = ([1, 5, 1, 130, 9], [40, 5, 300, 200, 9])


class RecordingKernels:
    """The reference kernel module, recording each call's arguments (cloned) before running it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Any:
        real = getattr(reference_kernels, name)

        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, dict(kwargs)))
            return real(*args, **kwargs)

        return record

    def named(self, name: str) -> list[tuple[tuple, dict]]:
        return [(a, k) for n, a, k in self.calls if n == name]


def test_layout_views_share_the_cache() -> None:
    assert kv_cache_shape(10, 128, 2, 64) == (2, 10, 128, 2, 64)
    cache = torch.randn(kv_cache_shape(10, 128, 2, 64)).half()
    keys, values = split_caches(cache)
    flat = as_page_attention_kv(keys)
    assert flat.shape == (10, 128, 128) and flat.data_ptr() == cache.data_ptr()
    assert values.data_ptr() == cache[1].data_ptr()
    with pytest.raises(ValueError, match="contiguous"):
        split_caches(cache.transpose(1, 2))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((16, 64), "block size 16"),
        ((128, 72), "head size 72"),
        ((128, 64, 12, 5), "not a multiple"),
        ((128, 64, 130, 2), "65 query heads per KV head"),
    ],
)
def test_geometry_the_kernels_refuse(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_geometry(*args)


def test_causal_mask_masks_strictly_above_the_diagonal() -> None:
    mask = causal_mask(torch.device("cpu"))
    assert mask.shape == (2048, 2048) and mask.dtype == torch.bool
    assert not mask[5, 5] and mask[5, 6] and not mask[2047, 0]


def metadata_for(
    query_lens: list[int], seq_lens: list[int], block_size: int = 128, **kw: Any
) -> AttentionMetadata:
    blocks = [-(-s // block_size) for s in seq_lens]
    width = max(blocks)
    tables = torch.tensor(
        [[7 * i + j for j in range(width)] for i in range(len(seq_lens))], dtype=torch.int32
    )
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.arange(sum(query_lens), dtype=torch.int64),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        scale=0.125,
        **kw,
    )


def test_plan_splits_decode_from_prefill_and_pads_prefill_rows() -> None:
    md = metadata_for(*MIXED)
    plan = build_step_plan(md, 146)
    decode, prefill = plan.launches
    assert decode.max_query_len == 1 and decode.sparse_mode == 0 and decode.query_lens is None
    assert decode.rows.tolist() == [0, 6]  # the rows of sequences 0 and 2
    assert decode.seq_lens == [40, 300] and decode.block_table.tolist() == md.block_tables[[0, 2]].tolist()
    assert prefill.sparse_mode == 3 and prefill.max_query_len == 130 and prefill.batch == 3
    assert prefill.query_lens == [5, 130, 9] and prefill.seq_lens == [5, 200, 9]
    assert prefill.rows.tolist() == [*range(1, 6), *range(7, 137), *range(137, 146)]
    assert prefill.padded_rows.tolist() == [*range(0, 5), *range(130, 260), *range(260, 269)]
    assert plan.slot_indices.dtype == torch.int32 and plan.slot_indices.tolist() == list(range(146))
    assert decode.block_table.dtype == torch.int32 == prefill.block_table.dtype


def test_a_pure_decode_step_needs_no_index_work() -> None:
    plan = build_step_plan(metadata_for([1, 1, 1], [3, 129, 256]), 3)
    (launch,) = plan.launches
    assert launch.rows is None and launch.padded_rows is None and launch.batch == 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sliding_window": 8}, "sliding-window"),
        ({"logits_soft_cap": 2.0}, "soft-capping"),
        ({"graph_capture": True}, "decode graph"),
    ],
)
def test_unclaimed_features_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_step_plan(metadata_for([1], [5], **change), 1)


def test_non_causal_steps_are_refused_naming_the_capability() -> None:
    # an encoder step (whole prompts, no prefix) is still refused: no launch here drops the causal mask
    with pytest.raises(NotImplementedError, match="non_causal_attention is not claimed"):
        build_step_plan(metadata_for([1, 5], [1, 5], causal=False), 6)


def test_inconsistent_metadata_is_refused() -> None:
    with pytest.raises(ValueError, match="sum to 6"):
        build_step_plan(metadata_for([1, 5], [3, 9]), 7)
    md = metadata_for([1], [100])
    md.seq_lens_cpu = [300]
    with pytest.raises(ValueError, match="columns"):
        build_step_plan(md, 1)
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        build_step_plan(metadata_for([4], [3]), 4)


def run_mixed(kernels: Any, dtype: torch.dtype = torch.float16) -> tuple[Any, torch.Tensor]:
    problem = make_attention_problem(
        5, MIXED[0], MIXED[1], 8, 2, 64, 128, 40, dtype=dtype, seed=5
    )  # fmt: skip
    backend = AscendAttentionBackend(kernels)
    return problem, problem.run(backend)


def test_mixed_batch_matches_the_float64_reference() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        problem, out = run_mixed(reference_kernels, dtype)
        assert out.dtype == dtype
        assert not compare(out, problem.reference_output(), problem.tolerance(), "mixed"), dtype


def test_kernel_arguments_follow_the_documented_layout() -> None:
    kernels = RecordingKernels()
    problem, _ = run_mixed(kernels)
    writes = kernels.named("reshape_and_cache")
    assert len(writes) == 2  # the prefix fill, then the step's own tokens
    (key, value, key_cache, value_cache, slots), _ = writes[1]
    assert slots.dtype == torch.int32 and key.is_contiguous() and key_cache.shape == (40, 128, 2, 64)
    attends = kernels.named("fused_infer_attention_score")
    assert [kw["sparse_mode"] for _, kw in attends] == [0, 3]
    (q_decode, k_flat, _), kw_decode = attends[0]
    assert q_decode.shape == (2, 1, 8, 64) and kw_decode["atten_mask"] is None
    assert k_flat.shape == (40, 128, 2 * 64) and kw_decode["input_layout"] == "BSND"
    assert (
        kw_decode["num_heads"] == 8
        and kw_decode["num_key_value_heads"] == 2
        and kw_decode["block_size"] == 128
    )
    (q_prefill, _, _), kw_prefill = attends[1]
    assert q_prefill.shape == (3, 130, 8, 64)
    # sequence 1 (5 new tokens) is batch 0: rows 1..5 of the flat query, then zero padding
    assert torch.equal(q_prefill[0, :5], problem.query[1:6]) and not q_prefill[0, 5:].any()
    assert torch.equal(q_prefill[2, :9], problem.query[137:146])
    assert kw_prefill["actual_seq_lengths"] == [5, 130, 9] and kw_prefill["actual_seq_lengths_kv"] == [
        5,
        200,
        9,
    ]
    assert kw_prefill["atten_mask"].shape == (2048, 2048)


def test_the_plan_is_built_once_per_step_and_the_mask_once_per_device() -> None:
    problem = make_attention_problem(2, [3, 1], [3, 20], 4, 2, 64, 128, 8, dtype=torch.float16, seed=9)
    backend = AscendAttentionBackend(reference_kernels)
    cache = problem.allocate_cache(backend)
    problem.fill_cache(backend, cache)
    backend.forward(problem.query, problem.key, problem.value, cache, problem.metadata)
    plan = problem.metadata.extras[PLAN_KEY]
    mask = backend._mask(torch.device("cpu"))
    backend.forward(problem.query, problem.key, problem.value, cache, problem.metadata)  # the next layer
    assert problem.metadata.extras[PLAN_KEY] is plan and backend._mask(torch.device("cpu")) is mask
    problem.metadata.slot_mapping = problem.metadata.slot_mapping.clone()  # a new step
    backend.forward(problem.query, problem.key, problem.value, cache, problem.metadata)
    assert problem.metadata.extras[PLAN_KEY] is not plan


def test_forward_refuses_what_the_kernels_cannot_run() -> None:
    backend = AscendAttentionBackend(reference_kernels)
    problem = make_attention_problem(1, [2], [2], 4, 2, 64, 128, 2, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        problem.run(backend, torch.zeros(backend.kv_cache_shape(2, 128, 2, 64)))
    half = make_attention_problem(1, [2], [2], 4, 2, 64, 128, 2, dtype=torch.float16, seed=1)
    with pytest.raises(ValueError, match="KV cache dtype"):
        backend.forward(
            half.query,
            half.key,
            half.value,
            torch.zeros(2, 2, 128, 2, 64, dtype=torch.bfloat16),
            half.metadata,
        )
    with pytest.raises(ValueError, match="slot_mapping has 1 entries for 2 tokens"):
        backend.write_kv(
            half.key, half.value, torch.zeros(2, 2, 128, 2, 64, dtype=torch.float16), torch.tensor([3])
        )


def test_the_substitute_enforces_the_kernel_contract() -> None:
    """The checks that make a CPU run meaningful: glue that breaks a documented rule must fail here."""
    q = torch.randn(1, 4, 2, 64).half()
    kv = torch.randn(2, 128, 2 * 64).half()
    args: dict[str, Any] = dict(
        block_table=torch.zeros(1, 1, dtype=torch.int32), actual_seq_lengths=[4], actual_seq_lengths_kv=[4],
        atten_mask=causal_mask(torch.device("cpu")), num_heads=2, num_key_value_heads=2, scale=0.1,
        input_layout="BSND", sparse_mode=3, block_size=128,
    )  # fmt: skip
    reference_kernels.fused_infer_attention_score(q, kv, kv, **args)
    bad = [
        ({"block_table": torch.zeros(1, 1, dtype=torch.int64)}, "int32"),
        ({"atten_mask": causal_mask(torch.device("cpu")).T.contiguous()}, "above the diagonal"),
        ({"atten_mask": None}, "2048 x 2048"),
        ({"actual_seq_lengths_kv": [3]}, "actual_seq_lengths <= actual_seq_lengths_kv"),
        ({"num_heads": 4}, "num_heads 4"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            reference_kernels.fused_infer_attention_score(q, kv, kv, **{**args, **change})
    with pytest.raises(ValueError, match="float16/bfloat16"):
        reference_kernels.fused_infer_attention_score(q.float(), kv.float(), kv.float(), **args)
    with pytest.raises(NotImplementedError, match="BSND"):
        reference_kernels.fused_infer_attention_score(q, kv, kv, **{**args, "input_layout": "TND"})
    cache = torch.zeros(2, 128, 2, 64).half()
    with pytest.raises(ValueError, match="int32"):
        reference_kernels.reshape_and_cache(q[0], q[0], cache, cache, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="beyond"):
        reference_kernels.reshape_and_cache(
            q[0], q[0], cache, cache, torch.tensor([0, 1, 2, 256], dtype=torch.int32)
        )


def test_negative_slots_are_not_written() -> None:
    backend = AscendAttentionBackend(SimpleNamespace(reshape_and_cache=reference_kernels.reshape_and_cache))
    cache = torch.randn(backend.kv_cache_shape(2, 128, 1, 64)).half()
    before = cache.clone()
    key = torch.randn(3, 1, 64).half()
    backend.write_kv(key, key, cache, torch.tensor([5, -1, 200]))
    keys, _ = backend.gather_kv(cache, [0, 1])
    assert torch.equal(keys[5], key[0]) and torch.equal(keys[200], key[2])
    untouched = [i for i in range(256) if i not in (5, 200)]
    assert torch.equal(keys[untouched], before[0].flatten(0, 1)[untouched])

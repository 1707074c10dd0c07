"""A step's pooling reductions (``pool_chunks``) against a float64 per-chunk reference, and pooled outputs
read one step later under async scheduling: blocks freed at once, an abort in between honoured."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dense_model_utils import PROMPTS

from engine import LLM, PoolingParams
from engine.pooling.pooler import PoolRows, pool_chunks, pooled_row_index
from engine_test_utils import assert_all_blocks_free


def _seq(prompt_len: int, pooling_type: str = "MEAN") -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=[0] * prompt_len, pooling=PoolingParams(pooling_type=pooling_type))


def _check(hidden: torch.Tensor, rows: list[PoolRows]) -> None:
    chunks = pool_chunks(hidden, rows).chunks()
    assert [c.seq for c in chunks] == [r.seq for r in rows]
    for r, c in zip(rows, chunks, strict=True):
        block = hidden[r.first_row : r.first_row + r.count].double()
        torch.testing.assert_close(c.total.double(), block.sum(0), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(c.first.double(), block[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(c.last.double(), block[-1], rtol=0, atol=1e-6)
        assert (c.first_position, c.count) == (r.first_position, r.count)
        if r.seq.pooling.per_token:
            torch.testing.assert_close(c.rows.double(), block, rtol=0, atol=1e-6)
        else:
            assert c.rows is None


@pytest.mark.parametrize(
    "layout",
    [
        [(0, 5), (5, 5), (10, 5)],  # equal prompts side by side: one reshaped sum
        [(0, 3), (3, 7), (10, 1)],  # unequal, side by side: segment sums
        [(1, 3), (6, 2), (9, 4)],  # rows of other requests (sampled ones) between them: gathered first
    ],
    ids=["equal", "unequal", "gaps"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_chunks_match_per_chunk_sums(layout, dtype):
    torch.manual_seed(len(layout) + layout[1][1])
    hidden = torch.randn(16, 24).to(dtype)
    rows = [PoolRows(_seq(c + 3), first_row=f, first_position=2, count=c) for f, c in layout]
    _check(hidden, rows)
    # a per-token request among them keeps every row, in order
    rows[1] = PoolRows(_seq(layout[1][1], "ALL"), layout[1][0], 0, layout[1][1])
    _check(hidden, rows)
    assert pool_chunks(hidden, rows).ending() == [rows[1].seq]  # the only chunk that ends its prompt


def test_pooled_row_index_names_the_row_each_chunk_reads_and_pooling_takes_those_rows():
    rows = [
        PoolRows(_seq(4, "CLS"), first_row=0, first_position=0, count=4),
        PoolRows(_seq(9, "LAST"), first_row=4, first_position=3, count=6),
        PoolRows(_seq(2, "CLS"), first_row=10, first_position=0, count=2),
    ]
    assert pooled_row_index(rows) == [0, 9, 10]
    torch.manual_seed(7)
    hidden = torch.randn(12, 8)
    picked = hidden[pooled_row_index(rows)]
    for r, c in zip(rows, pool_chunks(picked, rows, one_row_each=True).chunks(), strict=True):
        read = c.first if r.seq.pooling.pooling_type == "CLS" else c.last
        torch.testing.assert_close(read, hidden[r.first_row if r.seq.pooling.pooling_type == "CLS" else r.first_row + r.count - 1])
        assert (c.first_position, c.count) == (r.first_position, r.count)
    # any chunk that reads more than one row (MEAN, a per-token type) or an unresolved type: every row
    for kind in ("MEAN", "ALL", None):
        other = PoolRows(SimpleNamespace(prompt_token_ids=[0] * 3, pooling=PoolingParams(pooling_type=kind)), 12, 0, 3)
        assert pooled_row_index([*rows, other]) is None


def test_pooled_outputs_arrive_a_step_later_and_an_abort_between_is_honoured(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, runner="pooling")
    engine = llm.llm_engine
    assert engine.config.scheduler.async_scheduling
    expected = {p: llm.embed(p, use_tqdm=False)[0].outputs.data for p in PROMPTS[:2]}
    engine.add_request("a", PROMPTS[0], PoolingParams())
    engine.add_request("b", PROMPTS[1], PoolingParams())
    assert engine.step() == []  # both prompts computed; their vectors are still on their way
    assert engine.num_free_blocks == engine.num_total_blocks  # yet their blocks are free already
    assert engine.has_unfinished_requests()
    engine.abort_request("b")
    outs = engine.step()
    assert [o.request_id for o in outs] == ["a"]
    torch.testing.assert_close(outs[0].outputs.data, expected[PROMPTS[0]], rtol=0, atol=1e-6)
    assert_all_blocks_free(llm)
    # without async scheduling the step that computes a prompt returns its output
    sync = LLM(
        model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, runner="pooling",
        async_scheduling=False,
    )  # fmt: skip
    sync.llm_engine.add_request("c", PROMPTS[1], PoolingParams())
    (out,) = sync.llm_engine.step()
    torch.testing.assert_close(out.outputs.data, expected[PROMPTS[1]], rtol=0, atol=1e-6)
    assert_all_blocks_free(sync)

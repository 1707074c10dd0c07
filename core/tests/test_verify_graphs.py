"""The verification graphs' padding: rows of up to ``k + 1`` tokens into a bucket of fixed shape and back."""

from __future__ import annotations

import pytest
import torch
from echo_steps import EchoModel, step

from engine.interfaces.graph_capture import EagerGraphCapture
from engine.verify_graphs import VerifyGraphs


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.argmax(dim=-1), torch.log_softmax(logits, dim=-1).amax(dim=-1)


def make(max_batch: int = 6, query_len: int = 4, max_model_len: int = 64) -> tuple[VerifyGraphs, EchoModel]:
    model = EchoModel()
    graphs = VerifyGraphs(
        model,
        [],
        EagerGraphCapture(),
        max_batch,
        query_len,
        max_model_len,
        4,
        torch.device("cpu"),
        greedy=greedy,
    )
    graphs.capture()
    return graphs, model


def test_rows_pad_to_the_bucket_and_come_back_in_order() -> None:
    graphs, model = make()
    assert graphs.buckets == [1, 2, 4, 6]
    ids, pos, metadata = step([4, 1, 2], [10, 7, 20])
    bucket = graphs.bucket_for(metadata)
    assert bucket == 4
    out, picks = graphs.run(ids, pos, metadata, bucket)
    # the real tokens' hidden states, in the step's order, and each one's greedy pick and logprob
    assert torch.equal(out, torch.stack((ids, pos), dim=1).float())
    assert picks is not None and picks.shape == (2, 7) and picks.dtype == torch.float64
    assert picks[0].tolist() == (ids % 8).tolist()
    assert torch.allclose(picks[1], torch.log_softmax(torch.tensor([1.0] + [0.0] * 7), dim=0)[0].double())
    seen, padded_ids, padded_pos = model.seen[-1]
    assert seen.graph_capture and seen.query_lens_cpu == [4] * 4 and seen.max_query_len == 4
    assert seen.query_start_loc.tolist() == [0, 4, 8, 12, 16]
    # each row's context counts its padding; padding rows attend over their own 4 tokens
    assert seen.seq_lens.tolist() == [10, 10, 22, 4]
    slots = seen.slot_mapping.view(4, 4).tolist()
    assert slots[0] == metadata.slot_mapping[:4].tolist()
    assert slots[1] == [metadata.slot_mapping[4].item(), -1, -1, -1]
    assert slots[2] == [*metadata.slot_mapping[5:7].tolist(), -1, -1]
    assert slots[3] == [-1] * 4
    # a padding token repeats its row's last token and position
    assert padded_ids.view(4, 4)[1].tolist() == [ids[4].item()] * 4
    assert padded_pos.view(4, 4)[2].tolist() == [18, 19, 19, 19]
    assert seen.block_tables.shape == (4, 16)
    assert torch.equal(seen.block_tables[:3, : metadata.block_tables.shape[1]], metadata.block_tables)
    assert not seen.block_tables[3].any()


@pytest.mark.parametrize(
    "query_lens, seq_lens, why",
    [
        ([1, 1], [5, 9], "a pure decode is the decode graphs'"),
        ([5, 1], [9, 9], "a row longer than k + 1"),
        ([2] * 7, [9] * 7, "more rows than the largest bucket"),
        ([1, 2], [9, 63], "a padded context past the block-table width"),
    ],
)
def test_steps_of_other_shapes_run_eagerly(query_lens: list[int], seq_lens: list[int], why: str) -> None:
    graphs, _ = make()
    assert graphs.bucket_for(step(query_lens, seq_lens)[2]) is None, why


def test_a_non_causal_step_runs_eagerly() -> None:
    graphs, _ = make()
    metadata = step([3, 2], [3, 2])[2]
    metadata.causal = False
    assert graphs.bucket_for(metadata) is None


def test_buckets_stop_at_the_largest_verified_batch() -> None:
    graphs, _ = make(max_batch=256)
    assert graphs.buckets[-1] == 64
    # long proposals: a bucket holds at most 512 tokens
    assert make(max_batch=256, query_len=33)[0].buckets == [1, 2, 4, 8, 15]
    with pytest.raises(ValueError, match="2 to 512 tokens"):
        VerifyGraphs(EchoModel(), [], EagerGraphCapture(), 4, 1, 64, 4, torch.device("cpu"))

"""The prompt graphs' padding: one sequence's chunk into a token bucket of fixed shape and back."""

from __future__ import annotations

import pytest
import torch
from echo_steps import EchoModel, step

from engine.interfaces.graph_capture import EagerGraphCapture
from engine.prefill_graphs import PrefillGraphs, prefill_buckets


def make(max_tokens: int = 64, max_model_len: int = 128, window: int | None = None) -> tuple[PrefillGraphs, EchoModel]:
    model = EchoModel()
    graphs = PrefillGraphs(
        model, [], EagerGraphCapture(), max_tokens, max_model_len, 4, torch.device("cpu"), sliding_window=window
    )
    graphs.capture()
    return graphs, model


def test_buckets() -> None:
    assert prefill_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(8) == [8]
    with pytest.raises(ValueError, match="2 to 512 tokens"):
        PrefillGraphs(EchoModel(), [], EagerGraphCapture(), 1024, 2048, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds the context limit"):
        PrefillGraphs(EchoModel(), [], EagerGraphCapture(), 256, 200, 4, torch.device("cpu"))


@pytest.mark.parametrize("query_len, seq_len, bucket", [(37, 37, 64), (20, 57, 32), (16, 100, 16), (2, 9, 16)])
def test_a_chunk_pads_to_its_bucket_and_comes_back(query_len: int, seq_len: int, bucket: int) -> None:
    graphs, model = make(window=8)
    ids, pos, metadata = step([query_len], [seq_len])
    assert graphs.bucket_for(metadata) == bucket
    out = graphs.run(ids, pos, metadata, bucket)
    # the chunk's own hidden states, in order
    assert torch.equal(out, torch.stack((ids, pos), dim=1).float())
    seen, padded_ids, padded_pos = model.seen[-1]
    assert seen.graph_capture and seen.query_lens_cpu == [bucket] and seen.max_query_len == bucket
    assert seen.query_start_loc.tolist() == [0, bucket] and seen.sliding_window == 8
    # the context counts the padding, so that the real queries keep their positions
    assert seen.seq_lens.tolist() == [seq_len + bucket - query_len]
    assert seen.seq_lens.dtype == torch.int32
    assert seen.slot_mapping.tolist() == metadata.slot_mapping.tolist() + [-1] * (bucket - query_len)
    # a padding token repeats the chunk's last token and position
    assert padded_ids.tolist() == ids.tolist() + [ids[-1].item()] * (bucket - query_len)
    assert padded_pos.tolist() == pos.tolist() + [pos[-1].item()] * (bucket - query_len)
    assert seen.block_tables.shape == (1, 32)
    width = metadata.block_tables.shape[1]
    assert torch.equal(seen.block_tables[:, :width], metadata.block_tables) and not seen.block_tables[:, width:].any()


def test_the_same_bucket_replays_other_chunks() -> None:
    graphs, model = make()
    for query_len, seq_len in ((40, 40), (33, 90), (64, 64)):
        ids, pos, metadata = step([query_len], [seq_len])
        out = graphs.run(ids, pos, metadata, graphs.bucket_for(metadata) or 0)
        assert torch.equal(out, torch.stack((ids, pos), dim=1).float())
        assert model.seen[-1][0].seq_lens.tolist() == [seq_len + 64 - query_len]


@pytest.mark.parametrize(
    "query_lens, seq_lens, why",
    [
        ([1], [9], "a decode is the decode graphs'"),
        ([5, 3], [9, 9], "two sequences"),
        ([65], [65], "a chunk longer than the largest bucket"),
        ([20], [120], "a padded context past the block-table width"),
    ],
)
def test_steps_of_other_shapes_run_eagerly(query_lens: list[int], seq_lens: list[int], why: str) -> None:
    graphs, _ = make()
    assert graphs.bucket_for(step(query_lens, seq_lens)[2]) is None, why


def test_a_non_causal_step_runs_eagerly() -> None:
    graphs, _ = make()
    metadata = step([30], [30])[2]
    metadata.causal = False
    assert graphs.bucket_for(metadata) is None

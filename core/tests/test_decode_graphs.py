"""The core's decode-graph buckets, and the typed flag that tells a backend a step is being captured."""

from __future__ import annotations

from typing import Any

import torch

from engine.decode_graphs import DecodeGraphs, decode_buckets
from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.graph_capture import EagerGraphCapture


def test_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


class RecordingModel:
    """Stands in for the torch model: records the metadata of each step it is run with."""

    scale = 0.125

    def __init__(self) -> None:
        self.seen: list[AttentionMetadata] = []

    def forward(self, input_ids: torch.Tensor, positions: Any, kv_caches: Any, metadata: AttentionMetadata) -> torch.Tensor:
        self.seen.append(metadata)
        return torch.zeros(input_ids.shape[0], 4)


def test_captured_steps_carry_the_graph_capture_flag() -> None:
    model = RecordingModel()
    graphs = DecodeGraphs(model, [], EagerGraphCapture(), 4, 64, 16, torch.device("cpu"))
    graphs.capture()
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(4, dtype=torch.int32), seq_lens=torch.tensor([5, 9, 17], dtype=torch.int32),
        block_tables=torch.zeros((3, 2), dtype=torch.int32), slot_mapping=torch.tensor([4, 8, 16]),
        query_lens_cpu=[1, 1, 1], seq_lens_cpu=[5, 9, 17], max_query_len=1, max_seq_len=17, block_size=16, scale=0.125,
    )  # fmt: skip
    out = graphs.run(torch.tensor([1, 2, 3]), torch.tensor([4, 8, 16]), metadata)
    assert out is not None and out.shape == (3, 4)
    # padded to bucket 4, with host fields describing the bucket: the flag is how a backend knows
    step = model.seen[-1]
    assert step.graph_capture and step.num_seqs == 4 and step.max_seq_len == 64
    assert not metadata.graph_capture  # an eager step's default

"""The flat batch a step crosses to the device in: int32 fields as int32 views of the one transfer, and a pure
decode the decode graphs replay laid out in its bucket's shape by the host."""

from __future__ import annotations

import torch

from engine.block_manager import BlockManager
from engine.sampling.params import SamplingParams
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine.step_inputs import prepare_step_inputs


def decoding(block_manager: BlockManager, lengths: list[int]) -> SchedulerOutput:
    """A decode step of sequences whose contexts (the new token included) are ``lengths`` long, fresh
    random token ids, their blocks allocated."""
    generator = torch.Generator().manual_seed(sum(lengths))
    scheduled = []
    for seq_id, length in enumerate(lengths):
        prompt = torch.randint(1, 1000, (length - 1,), generator=generator).tolist()
        seq = Sequence(seq_id, f"r{seq_id}", 0, prompt, SamplingParams(max_tokens=4), arrival=seq_id)
        seq.output_token_ids = [int(torch.randint(1, 1000, (1,), generator=generator))]
        seq.num_computed_tokens = length - 1
        block_manager.allocate(seq_id, length)
        scheduled.append(ScheduledSequence(seq, 1, True))
    return SchedulerOutput(scheduled=scheduled)


def prepare(step: SchedulerOutput, block_manager: BlockManager, decode_shape=None):  # type: ignore[no-untyped-def]
    return prepare_step_inputs(
        step, None, block_manager=block_manager, device=torch.device("cpu"), scale=0.125, sliding_window=None,
        kv_layout=None, lora_manager=None, decode_shape=decode_shape,
    )  # fmt: skip


def test_int32_fields_are_views_of_the_one_transfer() -> None:
    blocks = BlockManager(64, 4)
    step = decoding(blocks, [5, 13, 2])
    inputs = prepare(step, blocks)
    md = inputs.metadata
    assert md.seq_lens.dtype == md.block_tables.dtype == md.query_start_loc.dtype == torch.int32
    assert md.seq_lens.tolist() == [5, 13, 2] and md.query_start_loc.tolist() == [0, 1, 2, 3]
    tables = [blocks.block_tables[i] for i in range(3)]
    assert md.block_tables.tolist() == [t + [0] * (4 - len(t)) for t in tables]
    # one storage: the int64 fields and the int32 ones came over together
    storage = inputs.input_ids.untyped_storage().data_ptr()
    assert md.seq_lens.untyped_storage().data_ptr() == md.block_tables.untyped_storage().data_ptr() == storage
    assert md.block_tables.data_ptr() % 16 == md.seq_lens.data_ptr() % 16 == 0
    assert [s.seq.output_token_ids[0] for s in step.scheduled] == inputs.input_ids.tolist()
    assert md.slot_mapping.tolist() == [blocks.slot(i, n - 1) for i, n in enumerate([5, 13, 2])]
    assert inputs.graph_inputs is None and inputs.logits_all_rows


def test_a_replayed_decode_comes_in_its_buckets_shape() -> None:
    blocks = BlockManager(64, 4)
    step = decoding(blocks, [5, 13, 2])
    asked: list[tuple[int, list[int]]] = []

    def bucket_of_four(num_seqs: int, widths: list[int]) -> tuple[int, int | None]:
        asked.append((num_seqs, widths))
        return 4, 6

    inputs = prepare(step, blocks, bucket_of_four)
    assert asked == [(3, [4])]
    assert inputs.graph_inputs is not None
    ids, positions, seq_lens, slots, tables = inputs.graph_inputs
    # padding rows: token 0 at position 0, no context, writing nowhere, a table of block 0
    assert ids.tolist() == inputs.input_ids.tolist() + [0] and positions.tolist() == [4, 12, 1, 0]
    assert seq_lens.dtype == tables.dtype == torch.int32 and seq_lens.tolist() == [5, 13, 2, 0]
    assert slots.tolist() == inputs.metadata.slot_mapping.tolist() + [-1]
    expected = [blocks.block_tables[i] for i in range(3)]
    assert tables.tolist() == [t + [0] * (6 - len(t)) for t in expected] + [[0] * 6]
    # the eager views see the real rows only
    md = inputs.metadata
    assert inputs.input_ids.shape == (3,) and md.seq_lens.tolist() == [5, 13, 2] and md.block_tables.shape == (3, 6)


def test_a_wide_table_is_left_for_the_device_to_pad() -> None:
    blocks = BlockManager(64, 4)
    inputs = prepare(decoding(blocks, [5, 9]), blocks, lambda n, widths: (4, None))
    assert inputs.graph_inputs is not None
    ids, _, seq_lens, slots, tables = inputs.graph_inputs
    assert ids.shape == seq_lens.shape == slots.shape == (4,) and tables.shape == (2, 3)


def test_a_step_with_a_prompt_chunk_is_not_laid_out_for_a_graph() -> None:
    blocks = BlockManager(64, 4)
    step = decoding(blocks, [5, 9])
    prompt = Sequence(7, "p", 0, [3, 4, 5, 6], SamplingParams(max_tokens=2), arrival=7)
    blocks.allocate(7, 4)
    step.scheduled.append(ScheduledSequence(prompt, 4, True))
    inputs = prepare(step, blocks, lambda n, widths: (4, 6))
    assert inputs.graph_inputs is None
    assert inputs.input_ids.tolist()[2:] == [3, 4, 5, 6] and inputs.metadata.query_start_loc.tolist() == [0, 1, 2, 6]
    # the prompt's logits row is its last token's: not every row in order
    assert inputs.logits_indices.tolist() == [0, 1, 5] and not inputs.logits_all_rows

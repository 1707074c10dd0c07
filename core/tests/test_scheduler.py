from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.sampling.params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make_seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=str(seq_id),
        index=0,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(),
        arrival=seq_id,
    )


def run_step(s: Scheduler, sample_token: int = 7):
    out = s.schedule()
    s.advance(out)
    for item in out.scheduled:
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.output_token_ids.append(sample_token)
    return out


def test_prefill_and_decode_share_a_step_and_long_prompts_are_chunked():
    bm = BlockManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=8), bm)
    a, b = make_seq(0, 6), make_seq(1, 25)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 6), (1, 4)]
    assert [i.samples for i in out.scheduled] == [True, False]
    out = run_step(s)
    # a decodes one token while b's prompt continues in a 9-token chunk
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 9)]
    out = run_step(s)
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 9)]
    out = run_step(s)
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 3)]
    assert out.scheduled[1].samples
    assert bm.block_tables[0] == [0, 1, 8]
    assert bm.block_tables[1] == [2, 3, 4, 5, 6, 7, 9]


def test_max_num_seqs_limits_admission():
    bm = BlockManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=2), bm)
    for i in range(3):
        s.add(make_seq(i, 3))
    out = run_step(s)
    assert [i.seq.seq_id for i in out.scheduled] == [0, 1]
    assert s.num_waiting == 1
    s.remove(s.running[0])
    out = run_step(s)
    assert [i.seq.seq_id for i in out.scheduled] == [1, 2]


def test_preemption_requeues_the_youngest_and_frees_its_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8), bm)
    a, b = make_seq(0, 4), make_seq(1, 4)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 1 block each, output token appended
    assert bm.num_free_blocks == 2
    run_step(s)  # both decode into a second block
    assert bm.block_tables == {0: [0, 2], 1: [1, 3]}
    for _ in range(3):
        run_step(s)
    # a needs a third block at token 9: b (the youngest) is preempted and a continues
    out = run_step(s)
    assert [p.seq_id for p in out.preempted] == [1]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert s.waiting[0] is b
    assert [i.seq.seq_id for i in out.scheduled] == [0]
    assert bm.block_tables[0] == [0, 2, 3]
    assert 1 not in bm.block_tables
    # once a finishes, b is recomputed from its prompt and its generated tokens
    s.remove(a)
    assert bm.num_free_blocks == 4
    out = run_step(s)
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(1, b.num_tokens - 1)]


def test_everything_is_freed_after_removal():
    bm = BlockManager(num_blocks=16, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8), bm)
    seqs = [make_seq(i, 5 + i) for i in range(4)]
    for q in seqs:
        s.add(q)
    for _ in range(6):
        run_step(s)
    for q in seqs:
        s.remove(q)
    assert bm.num_free_blocks == 16
    assert not s.has_work()


def test_swap_preemption_moves_blocks_to_host_and_back():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8), bm, num_host_blocks=4)
    a, b = make_seq(0, 4), make_seq(1, 4)
    s.add(a)
    s.add(b)
    for _ in range(5):
        run_step(s)
    assert bm.block_tables == {0: [0, 2], 1: [1, 3]}
    out = run_step(s)  # a needs a third block: b is swapped out, not recomputed
    assert [p.seq_id for p in out.preempted] == [1]
    assert out.swap_out == [(1, 0), (3, 1)]
    assert b.status is SequenceStatus.SWAPPED and b.num_computed_tokens == 8
    assert s.host_tables == {1: [0, 1]}
    s.remove(a)
    out = run_step(s)  # b comes back with its KV: only its next token runs
    assert out.swap_in == [(0, 1), (1, 3)]
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(1, 1)]
    assert bm.block_tables[1] == [1, 3, 2]
    assert s.host_allocator.num_free_blocks == 4
    s.remove(b)
    assert bm.num_free_blocks == 4


def test_priority_runs_first_but_aging_prevents_starvation():
    bm = BlockManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=1, priority_aging_steps=5), bm)
    low = make_seq(0, 2)
    low.priority = 3
    s.add(low)
    started_low_at = None
    for step in range(40):
        hi = make_seq(100 + step, 2)  # a fresh important request every step
        s.add(hi)
        out = s.schedule()
        s.advance(out)
        for item in out.scheduled:
            s.remove(item.seq)  # each finishes after its prefill
        if any(i.seq is low for i in out.scheduled):
            started_low_at = step
            break
    assert started_low_at is not None and started_low_at > 0, "the low-priority request starved"
    # Until it aged enough, important requests went first.
    assert started_low_at >= 3 * 5 // 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_delay_factor_holds_new_prompts_while_others_run_until_the_oldest_has_waited():
    bm = BlockManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=20, max_num_seqs=8, scheduler_delay_factor=2.0), bm)
    clock = s.clock = FakeClock()
    s.add(make_seq(0, 6))
    # nothing runs: the first prompt is admitted at once, and its step's length is what later ones wait on
    assert [i.seq.seq_id for i in run_step(s).scheduled] == [0]
    clock.now += 0.010  # the prompt step took 10 ms
    s.add(make_seq(1, 3))
    out = run_step(s)
    assert [i.seq.seq_id for i in out.scheduled] == [0]  # seq 1 waits: 0 s of the 20 ms it must wait
    clock.now += 0.010
    s.add(make_seq(2, 3))
    assert [i.seq.seq_id for i in run_step(s).scheduled] == [0]  # the oldest has waited 10 ms
    clock.now += 0.011
    out = run_step(s)  # 21 ms: both arrivals are prefilled together, in one step
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 3), (2, 3)]


def test_delay_factor_admits_at_once_what_fills_the_step_and_zero_means_no_delay():
    bm = BlockManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8, scheduler_delay_factor=5.0), bm)
    clock = s.clock = FakeClock()
    s.add(make_seq(0, 4))
    run_step(s)
    clock.now += 0.010
    s.add(make_seq(1, 4))
    assert [i.seq.seq_id for i in run_step(s).scheduled] == [0]
    s.add(make_seq(2, 4))  # 8 tokens wait for a step with 7 left: no reason to hold them back
    out = run_step(s)
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 4), (2, 3)]

    bm = BlockManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=20, max_num_seqs=8), bm)
    s.clock = FakeClock()
    s.add(make_seq(0, 4))
    run_step(s)
    s.add(make_seq(1, 4))
    assert [i.seq.seq_id for i in run_step(s).scheduled] == [0, 1]

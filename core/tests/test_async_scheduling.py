"""Overlapped (async) scheduling: the next step is issued before the last one's tokens are read back,
and every output equals the synchronous engine's, through preemption, stops, mixed sampling and aborts."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.launched_step import LaunchedStep
from engine_test_utils import assert_all_blocks_free

PROMPTS = [
    "Hello there",
    "The weather today is",
    "Numbers: 4, 8, 15,",
    "Once upon a time in a land far away, there lived",
    "A",
    "def fibonacci(n):",
]


def _llm(path: str, async_scheduling: bool, **kwargs) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", async_scheduling=async_scheduling, **kwargs)


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    return _llm(tiny_llama_dir, True, kv_cache_memory_bytes=32 << 20), _llm(tiny_llama_dir, False, kv_cache_memory_bytes=32 << 20)


def _tokens(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def test_next_step_is_issued_before_the_last_is_read(pair):
    overlapped, _ = pair
    engine = overlapped.llm_engine
    # the steps themselves, not their ids: a freed step's id may be a later step's, which miscounted overlaps
    events: list[tuple[str, LaunchedStep]] = []
    original_launch, original_resolve = engine.runner.launch, LaunchedStep.resolve

    def spying_launch(*args, **kwargs):
        launched = original_launch(*args, **kwargs)
        events.append(("launch", launched))
        return launched

    def spying_resolve(self):
        events.append(("resolve", self))
        return original_resolve(self)

    engine.runner.launch = spying_launch
    LaunchedStep.resolve = spying_resolve
    try:
        overlapped.generate(PROMPTS[:3], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        engine.runner.launch = original_launch
        LaunchedStep.resolve = original_resolve
    launches = [(at, step) for at, (kind, step) in enumerate(events) if kind == "launch"]

    def first_resolve(step: LaunchedStep) -> int | None:
        return next((at for at, (kind, s) in enumerate(events) if kind == "resolve" and s is step), None)

    overlaps = sum(
        1 for (_, a), (b_at, _) in zip(launches, launches[1:]) if (read := first_resolve(a)) is not None and b_at < read
    )
    # 12 tokens each: after the prefill step, nearly every step's tokens are read after the next is issued
    assert overlaps >= 9, f"{overlaps} of {len(launches) - 1} steps issued before the last was read"
    assert_all_blocks_free(overlapped)


def test_outputs_equal_the_synchronous_engine(pair):
    overlapped, synchronous = pair
    eos_free = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    reference = synchronous.generate(PROMPTS, eos_free, use_tqdm=False)
    stop_token = reference[2].outputs[0].token_ids[6]
    params = [
        eos_free,
        SamplingParams(max_tokens=9, temperature=0.0),  # EOS may end it
        SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0.9, seed=11, ignore_eos=True),  # host-sampled rows: sync steps
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, logprobs=2),  # top logprobs: sync steps
    ]
    got = overlapped.generate(PROMPTS, params, use_tqdm=False)
    want = synchronous.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert got[2].outputs[0].stop_reason == stop_token
    assert [len(o.outputs[0].token_ids) for o in got][3] == 5
    assert got[5].outputs[0].logprobs == want[5].outputs[0].logprobs
    assert_all_blocks_free(overlapped)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_steps_in_flight(tiny_llama_dir, pair, mode):
    _, synchronous = pair
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in synchronous.generate(PROMPTS, params, use_tqdm=False)]
    # 12 blocks of 8 tokens cannot hold six sequences of up to ~60 tokens: preemption must happen
    small = _llm(tiny_llama_dir, True, block_size=8, num_blocks_override=12, max_num_batched_tokens=64, preemption_mode=mode)
    outs = small.generate(PROMPTS, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_blocks_free(small)


def test_streamed_steps_and_abort_in_flight(pair):
    overlapped, synchronous = pair
    engine = overlapped.llm_engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = synchronous.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("keep", PROMPTS[1], params)
    engine.add_request("drop", PROMPTS[3], params)
    seen: list[list[int]] = []
    for _ in range(6):
        for out in engine.step():
            if out.request_id == "keep":
                seen.append(out.outputs[0].token_ids)
    assert engine._in_flight is not None  # a step is in flight as the request is aborted
    engine.abort_request("drop")
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "keep"
            seen.append(out.outputs[0].token_ids)
            final = out
    assert final is not None and final.finished
    assert final.outputs[0].token_ids == want
    # per-step outputs grow one real token at a time and never show a placeholder
    assert all(-1 not in ids for ids in seen)
    assert [len(ids) for ids in seen] == list(range(len(seen[0]), len(seen[0]) + len(seen)))
    assert_all_blocks_free(overlapped)


def test_a_request_that_ends_by_length_gets_no_row_after_its_last_token(tiny_llama_dir, pair):
    """``max_tokens`` (or the context limit) ends a sequence whatever its last token is: once that token is
    in flight no step computes another row for it, so a request of n tokens runs n steps, as the
    synchronous engine does (one prefill step and n - 1 decodes), not n + 1."""
    overlapped, synchronous = pair
    rows: list[int] = []
    launch = overlapped.llm_engine.runner.launch

    def counting_launch(plan, *args, **kwargs):
        rows.append(len(plan.scheduled))
        return launch(plan, *args, **kwargs)

    overlapped.llm_engine.runner.launch = counting_launch
    try:
        for n in (1, 2, 5):
            rows.clear()
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            got = overlapped.generate(PROMPTS[0], params, use_tqdm=False)
            assert got[0].outputs[0].token_ids == synchronous.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
            assert rows == [1] * n, (n, rows)
        # two requests ending at different lengths: the shorter one's row leaves the step after its last token
        rows.clear()
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 4)]
        assert [len(o.outputs[0].token_ids) for o in overlapped.generate(PROMPTS[:2], params, use_tqdm=False)] == [2, 4]
        assert rows == [2, 2, 1, 1], rows
    finally:
        overlapped.llm_engine.runner.launch = launch
    assert_all_blocks_free(overlapped)
    # the context limit: a window five tokens past the prompt ends the sequence there, its last token in flight
    prompt = overlapped.llm_engine.tokenizer.encode(PROMPTS[3])
    short = _llm(tiny_llama_dir, True, max_model_len=len(prompt) + 5, kv_cache_memory_bytes=8 << 20)
    rows.clear()
    short_launch = short.llm_engine.runner.launch
    short.llm_engine.runner.launch = lambda plan, *a, **k: (rows.append(len(plan.scheduled)), short_launch(plan, *a, **k))[1]
    out = short.generate([prompt], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True), use_tqdm=False)
    produced = len(out[0].outputs[0].token_ids)
    assert produced == 5 and out[0].outputs[0].finish_reason == "length"
    assert rows == [1] * produced, rows
    assert_all_blocks_free(short)


def test_a_step_that_cannot_overlap_after_one_that_did_adds_nothing_to_what_it_finished(pair):
    """A greedy request finished by an overlapped step's token, read only after the next step (which cannot
    overlap: a sampled request joined) was issued with a row for it: that row's token is dropped, whatever
    step the sampled request joins at."""
    overlapped, _ = pair
    engine = overlapped.llm_engine
    for joins_after in range(1, 6):
        engine.add_request(f"g{joins_after}", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        outputs = {}
        for _ in range(joins_after):
            outputs.update((o.request_id, o) for o in engine.step())
        engine.add_request(f"s{joins_after}", PROMPTS[1], SamplingParams(max_tokens=3, temperature=1.0, seed=1))
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
        assert len(outputs[f"g{joins_after}"].outputs[0].token_ids) == 4, joins_after
    assert_all_blocks_free(overlapped)


def test_unseeded_draws_overlap_and_equal_the_synchronous_engine(tiny_llama_dir):
    """Rows drawn with the engine's generator (temperature, top-k, min-p; no seed, nothing processed) leave
    their tokens in flight like greedy rows, and give the synchronous engine's tokens while every row is
    still running (a row that a stop ended in the step in flight is computed once more and takes a draw of
    the shared generator, so after such a row ends the two engines' draws part); a top-p row without top-k (whose
    nucleus may need a second pass) and a seeded row still sample synchronously."""
    overlapped = _llm(tiny_llama_dir, True, seed=5, kv_cache_memory_bytes=32 << 20)
    synchronous = _llm(tiny_llama_dir, False, seed=5, kv_cache_memory_bytes=32 << 20)
    drawn = [
        SamplingParams(max_tokens=15, temperature=0.8, top_k=20, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=1.0, min_p=0.05, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=0.7, top_k=5, top_p=0.9, ignore_eos=True),
    ]
    in_flight = []
    launch = overlapped.llm_engine.runner.launch

    def spying_launch(*args, **kwargs):
        launched = launch(*args, **kwargs)
        in_flight.append(launched.token_ids is not None)
        return launched

    overlapped.llm_engine.runner.launch = spying_launch
    got = overlapped.generate(PROMPTS[:4], drawn, use_tqdm=False)
    assert _tokens(got) == _tokens(synchronous.generate(PROMPTS[:4], drawn, use_tqdm=False))
    assert sum(in_flight) >= 10  # nearly every step left its draws on the device
    uneven = [SamplingParams(max_tokens=n, temperature=0.8, top_k=20, ignore_eos=True) for n in (3, 9, 15)]
    assert [len(o.outputs[0].token_ids) for o in overlapped.generate(PROMPTS[:3], uneven, use_tqdm=False)] == [3, 9, 15]
    in_flight.clear()
    top_p = overlapped.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in top_p] == [6, 6]
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=3)
    got = overlapped.generate(PROMPTS[:2], seeded, use_tqdm=False)
    assert _tokens(got) == _tokens(synchronous.generate(PROMPTS[:2], seeded, use_tqdm=False))
    assert not any(in_flight)
    assert_all_blocks_free(overlapped)

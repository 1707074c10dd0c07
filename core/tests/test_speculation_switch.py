"""The speculation switch: proposals stay on where steps with them decode faster, go off where steps
without them do (re-measured now and then), per batch-size class; and through the engine, a draft that
never agrees is switched off while the greedy tokens stay the target's own."""

from __future__ import annotations

from dense_model_utils import PROMPTS

from engine import LLM, SamplingParams
from engine.speculative.switch import PROBE_PERIOD, PROBE_STEPS, WARM_UP_STEPS, SpeculationSwitch
from engine_test_utils import assert_all_blocks_free


def _drive(switch: SpeculationSwitch, batch: int, rate_on: float, rate_off: float, steps: int) -> list[bool]:
    decisions = []
    for _ in range(steps):
        on = switch.allows(batch)
        decisions.append(on)
        switch.observe(batch, on, tokens=batch, seconds=batch / (rate_on if on else rate_off))
    return decisions


def test_proposals_stay_on_where_they_pay_and_go_off_where_they_do_not():
    switch = SpeculationSwitch()
    paying = _drive(switch, 1, rate_on=300.0, rate_off=100.0, steps=WARM_UP_STEPS + PROBE_STEPS + 2 * PROBE_PERIOD)
    # warm-up on, one probe off, then on except a probe of the losing mode every PROBE_PERIOD steps
    assert paying[:WARM_UP_STEPS] == [True] * WARM_UP_STEPS
    assert paying[WARM_UP_STEPS : WARM_UP_STEPS + PROBE_STEPS] == [False] * PROBE_STEPS
    assert paying.count(False) <= 3 * PROBE_STEPS
    costly = _drive(switch, 64, rate_on=400.0, rate_off=900.0, steps=WARM_UP_STEPS + PROBE_STEPS + 2 * PROBE_PERIOD)
    after = costly[WARM_UP_STEPS:]
    assert after.count(True) <= 2 * PROBE_STEPS  # only the re-measurements of the losing mode
    assert switch.steps_off == paying.count(False) + costly.count(False)
    # the classes are apart: batch 1 still proposes
    assert switch.allows(1) and switch.batch_class(3) == 2 and switch.batch_class(64) == 64


def test_the_switch_follows_a_workload_that_changes():
    switch = SpeculationSwitch()
    _drive(switch, 8, rate_on=100.0, rate_off=200.0, steps=WARM_UP_STEPS + PROBE_STEPS + 8)
    assert not switch.allows(8)
    # proposals start to pay (say, the requests turned copy-heavy): the next re-measurement finds it
    later = _drive(switch, 8, rate_on=500.0, rate_off=200.0, steps=2 * PROBE_PERIOD)
    assert later[-PROBE_PERIOD:].count(False) <= PROBE_STEPS  # on, but for re-measuring the other mode


def test_a_draft_that_never_agrees_is_switched_off_and_tokens_stay_the_same(tiny_llama_dir, tiny_qwen2_dir):
    kwargs = dict(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:2]
    expected = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]
    spec = LLM(**kwargs, speculative_config={"model": tiny_qwen2_dir, "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == expected
    stats = spec.llm_engine.stats()
    # a random draft of the target's size costs 4 forwards a step and keeps next to nothing
    assert stats["spec_acceptance_rate"] < 0.2
    assert stats["spec_steps_switched_off"] >= 20
    assert_all_blocks_free(spec)


def test_disable_by_batch_size_stops_proposals_for_large_batches(tiny_llama_dir):
    spec = LLM(
        model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20,
        speculative_config={"model": tiny_llama_dir, "num_speculative_tokens": 2, "disable_by_batch_size": 3},
    )  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    spec.generate(PROMPTS[:3], params, use_tqdm=False)
    assert spec.llm_engine.stats()["spec_num_proposed_tokens"] == 0
    spec.generate(PROMPTS[:2], params, use_tqdm=False)
    assert spec.llm_engine.stats()["spec_num_proposed_tokens"] > 0


def test_greedy_tokens_stay_the_same_whatever_the_switch_chooses(tiny_llama_dir, monkeypatch):
    """Steps with proposals, verified steps and overlapped steps without proposals, in a random order (a
    seeded coin instead of the measurements): the tokens are the plain engine's, max_tokens holds."""
    import random

    kwargs = dict(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["one two three four five one two three four five one two three", *PROMPTS[:3]]
    expected = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]
    coin = random.Random(3)
    monkeypatch.setattr(SpeculationSwitch, "allows", lambda self, batch: coin.random() < 0.5)
    for config in ({"method": "ngram", "num_speculative_tokens": 3}, {"model": tiny_llama_dir, "num_speculative_tokens": 3}):
        spec = LLM(**kwargs, speculative_config=config, max_num_batched_tokens=16)
        for _ in range(2):
            assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == expected
        if "model" in config:  # a draft equal to the target has its proposals accepted
            assert spec.llm_engine.stats()["spec_num_accepted_tokens"] > 0
        assert_all_blocks_free(spec)

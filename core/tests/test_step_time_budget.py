"""The step token budget chosen from a service target (``--target-step-time-ms``): the candidates, the choice
from timed steps, and the engine timing its own steps at start-up through ``LLM``, the CLI and refusals."""

from __future__ import annotations

import logging

import pytest

from engine import LLM, SamplingParams
from engine.entrypoints import cli
from engine.errors import EngineConfigError
from engine.step_time_budget import TIMED_RUNS, budget_candidates, choose_budget


def test_candidates_double_from_the_floor_up_to_the_configured_budget() -> None:
    assert budget_candidates(2048, 256) == [256, 512, 1024, 2048]
    assert budget_candidates(3000, 256) == [256, 512, 1024, 2048, 3000]
    assert budget_candidates(200, 256) == [200]


def test_the_largest_budget_within_the_target_is_kept_and_larger_ones_are_not_timed() -> None:
    timed: list[int] = []

    def step_seconds(n: int) -> float:
        timed.append(n)
        return n / 10_000 if len(timed) % TIMED_RUNS else n / 20_000  # the fastest of the runs counts

    budget, times = choose_budget(8192, 256, 0.06, step_seconds)
    assert budget == 1024 and times == {256: 0.0128, 512: 0.0256, 1024: 0.0512, 2048: 0.1024}
    assert 4096 not in timed


def test_a_target_below_every_step_keeps_the_floor() -> None:
    assert choose_budget(2048, 256, 1e-6, lambda n: n * 1e-4) == (256, {256: 0.0256})


def test_the_cli_takes_the_target() -> None:
    args = cli.build_parser().parse_args(["serve", "--target-step-time-ms", "40"])
    assert cli.engine_config_from_args(args).scheduler.target_step_time_ms == 40.0
    assert cli.engine_config_from_args(cli.build_parser().parse_args(["serve"])).scheduler.target_step_time_ms is None


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "fast"])
def test_the_cli_refuses_a_target_that_is_not_a_positive_number(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--target-step-time-ms", value])
    assert "--target-step-time-ms" in capsys.readouterr().err


def test_the_engine_times_its_steps_and_serves_with_the_budget_it_chose(
    tiny_llama_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    common = {"model": tiny_llama_dir, "max_num_seqs": 4, "max_num_batched_tokens": 512, "max_model_len": 256}
    with caplog.at_level(logging.INFO, logger="engine.step_time_budget"):
        generous = LLM(**common, target_step_time_ms=60_000)
    assert generous.llm_engine.config.scheduler.max_num_batched_tokens == 512
    assert "step budget: 512 tokens for a 60000 ms step target (4 tokens" in caplog.text
    with caplog.at_level(logging.INFO, logger="engine.step_time_budget"):
        strict = LLM(**common, target_step_time_ms=1e-6)
    # no step is that fast: the floor, a step of the running streams' decode rows
    assert strict.llm_engine.config.scheduler.max_num_batched_tokens == 4
    assert strict.llm_engine.scheduler.config.max_num_batched_tokens == 4
    assert "even a step of 4 tokens takes longer than" in caplog.text
    # a 40-token prompt now runs in chunks of 4 tokens, and its tokens are the generous engine's
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = [1, *range(10, 49)]
    assert [o.outputs[0].token_ids for o in strict.generate([prompt], params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in generous.generate([prompt], params, use_tqdm=False)
    ]


def test_tensor_parallelism_refuses_the_target(tiny_llama_dir: str) -> None:
    with pytest.raises(EngineConfigError, match="target-step-time-ms is not supported with tensor"):
        LLM(model=tiny_llama_dir, tensor_parallel_size=2, target_step_time_ms=50)

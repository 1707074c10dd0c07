"""The step token budget chosen from a service target (``SchedulerConfig.target_step_time_ms``).

Under load a step mixes the running streams' decode rows with chunks of waiting prompts, up to
``max_num_batched_tokens`` tokens, and every stream waits for the whole step before its next token. How
long a step of so many tokens takes depends on the device and the model, so a budget that suits one
deployment stalls the streams of another. With a target, the engine times steps of prompt tokens at
start-up (after the warm-up has compiled their kernels), doubling from the smallest useful budget up to
the configured one, and keeps the largest whose step ran within the target.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.warm_up import run_warm_up, warm_up_batches

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

#: timings of each budget; the fastest counts (the first may still pick a library's kernel for the shape)
TIMED_RUNS = 2


def budget_candidates(configured: int, floor: int) -> list[int]:
    """Budgets to time: ``floor``, doubling, then ``configured`` itself (``floor`` capped at ``configured``)."""
    floor = max(1, min(floor, configured))
    sizes = [floor]
    while sizes[-1] * 2 < configured:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != configured:
        sizes.append(configured)
    return sizes


def choose_budget(
    configured: int, floor: int, target_s: float, step_seconds: Callable[[int], float]
) -> tuple[int, dict[int, float]]:
    """The largest candidate budget whose step took at most ``target_s``, and every timing made.

    Args:
        configured: the budget as configured (the largest candidate).
        floor: the smallest budget worth keeping (a step must hold the decode rows, or a whole prompt).
        target_s: the service target, in seconds.
        step_seconds: times one step of that many prompt tokens (waiting for the device).

    Returns:
        The budget (``floor`` when even its step missed the target) and the fastest time of each budget
        timed; budgets past the first that missed the target are not timed (they only take longer).
    """
    times: dict[int, float] = {}
    for budget in budget_candidates(configured, floor):
        times[budget] = min(step_seconds(budget) for _ in range(TIMED_RUNS))
        if times[budget] > target_s:
            break
    fitting = [b for b, t in times.items() if t <= target_s]
    return (max(fitting) if fitting else min(times)), times


def prompt_step_timer(
    run_steps: Callable[[list], float], max_num_seqs: int, max_model_len: int, block_size: int, whole_prompts: bool
) -> Callable[[int], float]:
    """Times one step of ``n`` prompt tokens (whole prompts of up to ``max_model_len``, as the warm-up's
    prefill step) through ``run_steps`` (the warm-up's runner, which waits for the device)."""

    def step_seconds(n: int) -> float:
        prefill = warm_up_batches(n, max_num_seqs, max_model_len, block_size, eager_decode=False, whole_prompts=whole_prompts)[0]
        return run_steps([prefill])

    return step_seconds


def with_fitted_step_budget(config: EngineConfig, runner: ModelRunner, max_model_len: int) -> EngineConfig:
    """``config`` with ``max_num_batched_tokens`` lowered to what its ``target_step_time_ms`` allows on
    ``runner``'s device (dummy steps: negative slots, the cache untouched)."""
    sched = config.scheduler
    assert sched.target_step_time_ms is not None
    model = runner.model
    whole = bool(getattr(model, "needs_whole_prompt", False))
    # a step must hold every running stream's decode row, or an encoder's whole prompt
    floor = max_model_len if whole else sched.max_num_seqs
    greedy = runner.sampler.greedy_on_device if getattr(model, "generates", True) else None

    def run_steps(batches: list) -> float:
        return run_warm_up(
            model, runner.layer_caches, batches, config.cache.block_size, runner.device, runner.sliding_window,
            runner.kv_layout, greedy=greedy, log=False,
        )  # fmt: skip

    timer = prompt_step_timer(run_steps, sched.max_num_seqs, max_model_len, config.cache.block_size, whole)
    budget, times = choose_budget(sched.max_num_batched_tokens, floor, sched.target_step_time_ms / 1e3, timer)
    timings = ", ".join(f"{n} tokens {t * 1e3:.1f} ms" for n, t in times.items())
    if times[budget] > sched.target_step_time_ms / 1e3:
        logger.warning(
            "step budget: even a step of %d tokens takes longer than the %.0f ms target (%s); keeping %d",
            budget, sched.target_step_time_ms, timings, budget,
        )  # fmt: skip
    else:
        logger.info(
            "step budget: %d tokens for a %.0f ms step target (%s)", budget, sched.target_step_time_ms, timings
        )
    return config.model_copy(update={"scheduler": sched.model_copy(update={"max_num_batched_tokens": budget})})

"""The step token budget when the user sets none: the platform's, an encoder's own, else the core's."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.engine_setup import ENCODER_STEP_TOKENS, with_step_budget
from engine.interfaces.platform import Platform


class Decoder:
    needs_whole_prompt = False


class Encoder:
    needs_whole_prompt = True


class BudgetPlatform:
    """Just the one method ``with_step_budget`` asks of a platform."""

    def __init__(self, budget: int | None, encoder_budget: int | None = None) -> None:
        self.budget = budget
        self.encoder_budget = encoder_budget

    def default_max_num_batched_tokens(self) -> int | None:
        return self.budget

    def default_encoder_step_tokens(self) -> int | None:
        return self.encoder_budget


def budget(config: EngineConfig, platform: BudgetPlatform, model_class: type) -> int:
    return with_step_budget(config, platform, model_class).scheduler.max_num_batched_tokens


def test_the_platform_budget_applies_unless_the_user_set_one():
    assert budget(EngineConfig(), BudgetPlatform(8192), Decoder) == 8192
    assert budget(EngineConfig(), BudgetPlatform(None), Decoder) == 2048
    assert budget(EngineConfig(scheduler={"max_num_batched_tokens": 512}), BudgetPlatform(8192), Decoder) == 512
    # the user's value, even when it equals the core's default
    assert budget(EngineConfig(scheduler={"max_num_batched_tokens": 2048}), BudgetPlatform(8192), Decoder) == 2048


def test_encoders_take_the_platforms_encoder_budget_else_the_cores_and_at_least_their_context():
    assert budget(EngineConfig(), BudgetPlatform(8192), Encoder) == ENCODER_STEP_TOKENS
    assert budget(EngineConfig(), BudgetPlatform(None), Encoder) == ENCODER_STEP_TOKENS
    assert budget(EngineConfig(), BudgetPlatform(8192, 4096), Encoder) == 4096
    # a step holds any prompt the model takes: the context length raises a smaller budget
    assert with_step_budget(EngineConfig(), BudgetPlatform(None, 4096), Encoder, 8192).scheduler.max_num_batched_tokens == 8192
    assert budget(EngineConfig(scheduler={"max_num_batched_tokens": 512}), BudgetPlatform(None, 4096), Encoder) == 512


def test_the_cpu_keeps_the_core_decoder_budget_and_takes_a_smaller_encoder_step():
    from engine_plugin_cpu.platform import CpuPlatform

    assert Platform.default_max_num_batched_tokens(CpuPlatform()) is None
    assert budget(EngineConfig(), CpuPlatform(), Decoder) == 2048
    # encoders take the CPU's own, smaller step (a step's activations stay in cache)
    assert Platform.default_encoder_step_tokens(CpuPlatform()) is None
    assert budget(EngineConfig(), CpuPlatform(), Encoder) == CpuPlatform().default_encoder_step_tokens() < ENCODER_STEP_TOKENS


def test_another_process_of_the_engine_applies_the_same_budget():
    # the engine core, replicas and ranks get the configuration as JSON: an unset budget must stay unset
    # there (it came back set to the core's 2048 once, and the GPU's serving ran 2048-token steps)
    for config in (EngineConfig(), EngineConfig(scheduler={"max_num_batched_tokens": 512})):
        copy = EngineConfig.model_validate_json(config.to_process_json())
        assert copy == config
        assert budget(copy, BudgetPlatform(8192), Decoder) == budget(config, BudgetPlatform(8192), Decoder)
    replica = EngineConfig().model_copy(update={"seed": 3})
    assert EngineConfig.model_validate_json(replica.to_process_json()).seed == 3

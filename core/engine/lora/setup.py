"""Turning LoRA on for an engine: what it refuses, and the slots and manager it builds."""

from __future__ import annotations

import logging
from typing import Any

from engine.lora.manager import LoraManager
from engine.lora.slots import LoraSlots
from engine.lora.targets import decoder_targets

logger = logging.getLogger(__name__)


def lora_config_problems(config: Any, platform: Any, model_class: Any) -> list[str]:
    """Why ``enable_lora`` cannot run with this configuration, platform and model (empty: it can).

    Args:
        config: the :class:`~engine.config.EngineConfig` (its ``lora`` set).
        platform: the selected platform.
        model_class: the resolved model class (None: the platform runs its own model).
    """
    if config.lora is None:
        return []
    problems = []
    if not platform.capabilities().lora:
        problems.append(f"enable_lora needs batched LoRA, which {platform.name} does not support (Capabilities.lora)")
    from engine.models.layers.decoder import DenseDecoder

    if model_class is None or not isinstance(model_class, type) or not issubclass(model_class, DenseDecoder):
        name = getattr(model_class, "__name__", "the platform's own model runner")
        problems.append(f"enable_lora runs on the core's decoder models; {name} is not one")
    if config.parallel.world_size > 1 or config.parallel.data_parallel_size > 1:
        problems.append("enable_lora with tensor, pipeline or data parallelism is not supported yet")
    if config.speculative_config is not None:
        problems.append("enable_lora with speculative decoding is not supported yet")
    return problems


def attach_lora(config: Any, model: Any) -> LoraManager | None:
    """Allocate the adapter slots on the model's projections and the manager over them (None: LoRA off).

    Called after the weights load and before the KV pool is sized, so the slots count as model memory.
    """
    if config.lora is None:
        return None
    targets = decoder_targets(model)
    slots = LoraSlots(model, targets, config.lora.max_loras, config.lora.max_lora_rank)
    for layer in model.layers:
        # adapters add to each projection's output from its plain input: no FP8-quantized inputs
        layer.qkv_fp8 = layer.gate_up_fp8 = layer.down_fp8 = None
    logger.info(
        "LoRA: %d slots of rank %d on %d modules (%.1f MiB on the device)",
        config.lora.max_loras, config.lora.max_lora_rank, len(targets.parts), slots.nbytes / 2**20,
    )  # fmt: skip
    return LoraManager(config.lora, slots, targets)

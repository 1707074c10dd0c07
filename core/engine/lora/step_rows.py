"""A step's rows and their adapter slots: the scheduler's step, after the manager made its adapters resident."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.interfaces.lora import LoraStep

if TYPE_CHECKING:
    from engine.lora.manager import LoraManager
    from engine.scheduler import SchedulerOutput


def lora_rows(
    manager: LoraManager, step: SchedulerOutput, device: torch.device, logits_indices: list[int]
) -> tuple[LoraStep | None, LoraStep | None]:
    """Make the step's adapters resident and name each row's slot, in the runner's row order (each
    scheduled sequence's new tokens, in turn), and each logits row's (the rows ``logits_indices`` picks
    for the lm_head); (None, None) when no sequence runs under an adapter."""
    ids = {item.seq.lora_id for item in step.scheduled if item.seq.lora_id}
    if not ids:
        return None, None
    slot_of = manager.activate(ids)
    rows: list[int] = []
    for item in step.scheduled:
        rows += [slot_of[item.seq.lora_id] if item.seq.lora_id else -1] * item.num_new_tokens
    logits = [rows[i] for i in logits_indices]
    both = torch.tensor(rows + logits, dtype=torch.int32)
    if device.type != "cpu":
        both = both.pin_memory()
    both = both.to(device, non_blocking=True)
    slots = manager.config.max_loras
    return LoraStep(both[: len(rows)], tuple(rows), slots), LoraStep(both[len(rows) :], tuple(logits), slots)

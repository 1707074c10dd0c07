"""The device slots adapters run from: every targeted projection's :class:`LoraWeights`, one slot per
adapter, filled and emptied as adapters come and go (the tensors stay put, so recorded graphs stay valid)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.interfaces.lora import LoraWeights
from engine.lora.peft_adapter import LoraAdapter
from engine.lora.targets import PROJECTIONS, LoraTargets
from engine.models.layers.rope import interleaved_to_halves


@dataclass(slots=True)
class LayerLora:
    """A layer's projections' slots (None: no adapter can target that projection in this layer)."""

    qkv: LoraWeights | None = None
    o: LoraWeights | None = None
    gate_up: LoraWeights | None = None
    down: LoraWeights | None = None


class LoraSlots:
    """Allocates ``num_slots`` zeroed slots of rank ``max_rank`` (per module) on every targetable
    projection of ``model`` and attaches them to its layers (``DecoderLayer.lora``).

    Args:
        model: a dense decoder (its layers, device and dtype).
        targets: what adapters may target.
        num_slots: ``max_loras``.
        max_rank: ``max_lora_rank``.
    """

    def __init__(self, model: Any, targets: LoraTargets, num_slots: int, max_rank: int) -> None:
        self.targets = targets
        self.num_slots = num_slots
        self.max_rank = max_rank
        device, dtype = model.device, model.dtype
        present = {(layer, part.projection) for layer, part in targets.parts.values()}
        self.layers: list[LayerLora] = []
        for index, layer in enumerate(model.layers):
            owned = LayerLora()
            for projection in PROJECTIONS:
                if (index, projection) not in present:
                    continue
                bands, out, inp = targets.shapes[projection]
                rank = bands * max_rank
                setattr(owned, projection, LoraWeights(
                    a=torch.zeros(num_slots, rank, inp, device=device, dtype=dtype),
                    b=torch.zeros(num_slots, out, rank, device=device, dtype=dtype),
                    scales=torch.zeros(num_slots, device=device, dtype=torch.float32),
                ))  # fmt: skip
            layer.lora = owned
            self.layers.append(owned)

    @property
    def nbytes(self) -> int:
        """Device bytes the slots take."""
        total = 0
        for layer in self.layers:
            for projection in PROJECTIONS:
                w = getattr(layer, projection)
                if w is not None:
                    total += w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
        return total

    def clear(self, slot: int) -> None:
        """Empty a slot: its rows add nothing."""
        for layer in self.layers:
            for projection in PROJECTIONS:
                w = getattr(layer, projection)
                if w is not None:
                    w.a[slot].zero_()
                    w.b[slot].zero_()
                    w.scales[slot] = 0.0

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put an adapter (already checked against the targets) into a slot, its scales folded into ``B``."""
        self.clear(slot)
        r_max = self.max_rank
        for module, update in adapter.modules.items():
            index, part = self.targets.parts[module]
            w = getattr(self.layers[index], part.projection)
            band, r = part.band * r_max, update.rank
            first, count = part.rows
            w.a[slot, band : band + r].copy_(update.a)
            w.b[slot, first : first + count, band : band + r].copy_(update.b * update.scale)
            w.scales[slot] = 1.0
        rope = self.targets.interleaved_rope
        if rope is not None:
            heads, kv_heads, head_dim, rotary_dim = rope
            q, kv = heads * head_dim, kv_heads * head_dim
            for layer in self.layers:
                if layer.qkv is None:
                    continue
                b = layer.qkv.b[slot]
                # the Q/K rows follow the base weights' load-time permutation
                b[:q] = interleaved_to_halves(b[:q].clone(), heads, head_dim, rotary_dim)
                b[q : q + kv] = interleaved_to_halves(b[q : q + kv].clone(), kv_heads, head_dim, rotary_dim)

"""The device slots adapters run from: every targeted projection's :class:`LoraWeights`, one slot per
adapter, filled and emptied as adapters come and go (the tensors stay put, so recorded graphs stay valid)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.interfaces.lora import LoraStep, LoraWeights
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


@dataclass(slots=True)
class EmbeddingLora:
    """The token embeddings' adapters: ``hidden[t] += scale * B @ A[:, id_t]``.

    Attributes:
        rows: ``[slots, vocab, rank]``, each slot's ``A`` transposed, so a token's column is one row to gather.
        expand: ``B`` and the scales behind an identity ``A``: the gathered rows go through
            :meth:`GemmBackend.add_lora` as its shrunk input.
    """

    rows: torch.Tensor
    expand: LoraWeights

    def add(self, gemm: Any, hidden: torch.Tensor, input_ids: torch.Tensor, step: LoraStep, plan: Any) -> None:
        """Add each token's adapter update to its embedding (rows without an adapter gather zeros)."""
        slots = step.token_slots.long()
        own = (slots >= 0).unsqueeze(1)
        gathered = self.rows[slots.clamp(min=0), input_ids] * own.to(self.rows.dtype)
        gemm.add_lora(hidden, gathered, self.expand, plan)


def _zeros(num_slots: int, rank: int, out: int, inp: int, device: Any, dtype: Any) -> LoraWeights:
    return LoraWeights(
        a=torch.zeros(num_slots, rank, inp, device=device, dtype=dtype),
        b=torch.zeros(num_slots, out, rank, device=device, dtype=dtype),
        scales=torch.zeros(num_slots, device=device, dtype=torch.float32),
    )


class LoraSlots:
    """Allocates ``num_slots`` zeroed slots of rank ``max_rank`` (per module) on every targetable
    projection of ``model`` and attaches them to it (``DecoderLayer.lora``, ``lora_head``, ``lora_embed``).

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
                if (index, projection) in present:
                    bands, out, inp = targets.shapes[projection]
                    setattr(owned, projection, _zeros(num_slots, bands * max_rank, out, inp, device, dtype))
            layer.lora = owned
            self.layers.append(owned)
        _, vocab, hidden = targets.shapes["lm_head"]
        self.head = _zeros(num_slots, max_rank, vocab, hidden, device, dtype)
        identity = torch.eye(max_rank, device=device, dtype=dtype).expand(num_slots, max_rank, max_rank).contiguous()
        expand = LoraWeights(identity, torch.zeros(num_slots, hidden, max_rank, device=device, dtype=dtype),
                             torch.zeros(num_slots, device=device, dtype=torch.float32))  # fmt: skip
        self.embed = EmbeddingLora(torch.zeros(num_slots, vocab, max_rank, device=device, dtype=dtype), expand)
        #: the slots whose adapter updates the lm_head / the embeddings: with none, the model skips them
        #: outside recorded graphs
        self.head_slots: set[int] = set()
        self.embed_slots: set[int] = set()
        model.lora_head, model.lora_embed, model.lora_slots = self.head, self.embed, self

    def _all(self) -> list[LoraWeights]:
        weights = [w for layer in self.layers for w in (getattr(layer, p) for p in PROJECTIONS) if w is not None]
        return [*weights, self.head, self.embed.expand]

    @property
    def nbytes(self) -> int:
        """Device bytes the slots take."""
        total = self.embed.rows.numel() * self.embed.rows.element_size()
        for w in self._all():
            total += w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
        return total

    def clear(self, slot: int) -> None:
        """Empty a slot: its rows add nothing."""
        for w in self._all():
            if w is not self.embed.expand:  # its A is the identity, for every slot
                w.a[slot].zero_()
            w.b[slot].zero_()
            w.scales[slot] = 0.0
        self.embed.rows[slot].zero_()
        self.head_slots.discard(slot)
        self.embed_slots.discard(slot)

    @contextlib.contextmanager
    def every_part_in(self, slot: int) -> Iterator[None]:
        """Within the block, ``slot`` counts as updating the lm_head and the embeddings too, whatever it holds:
        the start-up warm-up runs every adapter kernel through it (an empty slot adds zeros)."""
        kept = set(self.head_slots), set(self.embed_slots)
        self.head_slots.add(slot)
        self.embed_slots.add(slot)
        try:
            yield
        finally:
            self.head_slots, self.embed_slots = kept

    def _weights(self, index: int, projection: str) -> LoraWeights:
        if projection == "lm_head":
            return self.head
        if projection == "embed":
            return self.embed.expand
        return getattr(self.layers[index], projection)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put an adapter (already checked against the targets) into a slot, its scales folded into ``B``."""
        self.clear(slot)
        r_max = self.max_rank
        for module, update in adapter.modules.items():
            index, part = self.targets.parts[module]
            w = self._weights(index, part.projection)
            band, r = part.band * r_max, update.rank
            first, count = part.rows
            if part.projection == "lm_head":
                self.head_slots.add(slot)
            if part.projection == "embed":
                self.embed_slots.add(slot)
                self.embed.rows[slot, :, :r].copy_(update.a.T)
            else:
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

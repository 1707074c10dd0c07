"""The engine's adapters: which it knows, which are loaded in host memory, which sit in device slots."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from engine.errors import InvalidRequestError
from engine.lora.config import LoRAConfig
from engine.lora.peft_adapter import LoraAdapter, LoraLoadError, load_peft_adapter
from engine.lora.request import LoRARequest
from engine.lora.slots import LoraSlots
from engine.lora.targets import LoraTargets, check_adapter

logger = logging.getLogger(__name__)


class LoraManager:
    """Adapters by id; a least-recently-used host cache of ``max_cpu_loras`` loaded adapters; and
    ``max_loras`` device slots, each holding one adapter, reassigned least recently used first.

    Args:
        config: the engine's LoRA settings.
        slots: the model's device slots.
        targets: what adapters may target (for checking them at registration).
    """

    def __init__(self, config: LoRAConfig, slots: LoraSlots, targets: LoraTargets) -> None:
        self.config = config
        self.slots = slots
        self.targets = targets
        self.known: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, LoraAdapter] = OrderedDict()
        #: adapter id -> slot, least recently used first
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self._free_slots = list(range(config.max_loras))
        #: bumped per registration, so a re-registered id never shares cached prompt blocks with the old one
        self._generation: dict[int, int] = {}
        self._next_generation = 1
        self.num_loads = 0

    def add(self, request: LoRARequest) -> bool:
        """Register an adapter, loading it to host memory now so a broken one fails here.

        Returns:
            False when the same adapter (id, name and path) is already registered.

        Raises:
            InvalidRequestError: the adapter cannot be read or does not fit this model, or its id or name
                is already taken by another adapter.
        """
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if known == request:
                return False
            raise InvalidRequestError(f"LoRA id {request.lora_int_id} is already used by adapter {known.lora_name!r}", param="lora_request")
        for other in self.known.values():
            if other.lora_name == request.lora_name:
                raise InvalidRequestError(f"a LoRA adapter named {request.lora_name!r} is already loaded (id {other.lora_int_id})", param="lora_request")
        self._load(request)
        self.known[request.lora_int_id] = request
        self._generation[request.lora_int_id] = self._next_generation
        self._next_generation += 1
        return True

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (its slot emptied); False when it was not registered. The caller makes sure
        no request still runs under it."""
        if self.known.pop(lora_id, None) is None:
            return False
        self._host.pop(lora_id, None)
        self._generation.pop(lora_id, None)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self.slots.clear(slot)
            self._free_slots.append(slot)
        return True

    def list(self) -> list[LoRARequest]:
        return list(self.known.values())

    def cache_key(self, lora_id: int) -> tuple[str, int]:
        """What a sequence under the adapter adds to its prefix-cache keys."""
        return ("lora", self._generation[lora_id])

    def _load(self, request: LoRARequest) -> LoraAdapter:
        cached = self._host.get(request.lora_int_id)
        if cached is not None:
            self._host.move_to_end(request.lora_int_id)
            return cached
        try:
            adapter = load_peft_adapter(request)
            check_adapter(adapter, self.targets, self.config.max_lora_rank)
        except LoraLoadError as exc:
            raise InvalidRequestError(str(exc), param="lora_request") from None
        self.num_loads += 1
        self._host[request.lora_int_id] = adapter
        while len(self._host) > self.config.host_capacity:
            evicted, _ = self._host.popitem(last=False)
            logger.debug("LoRA adapter %d leaves the host cache", evicted)
        return adapter

    def activate(self, lora_ids: set[int]) -> dict[int, int]:
        """Make the step's adapters resident, evicting the least recently used others.

        Args:
            lora_ids: the step's distinct adapters, at most ``max_loras`` (the scheduler's limit).

        Returns:
            Adapter id -> slot for every id asked for.
        """
        if len(lora_ids) > self.config.max_loras:
            raise RuntimeError(f"a step names {len(lora_ids)} adapters; max_loras is {self.config.max_loras}")
        for lora_id in lora_ids:
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                continue
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                victim = next(v for v in self._slot_of if v not in lora_ids)
                slot = self._slot_of.pop(victim)
            self.slots.write(slot, self._load(self.known[lora_id]))
            self._slot_of[lora_id] = slot
        return {lora_id: self._slot_of[lora_id] for lora_id in lora_ids}

    def stats(self) -> dict[str, Any]:
        return {
            "registered": len(self.known), "in_host_memory": len(self._host), "in_device_slots": len(self._slot_of),
            "loads_from_disk": self.num_loads,
        }  # fmt: skip

"""The engine's side of adapters: a request's ``lora_request`` checked and turned into what its sequences
carry, and the add / remove / list calls behind ``LLM`` and the server."""

from __future__ import annotations

from collections.abc import Iterable

from engine.errors import InvalidRequestError
from engine.lora.manager import LoraManager
from engine.lora.request import LoRARequest
from engine.sequence import Sequence

NOT_ENABLED = "LoRA adapters need an engine started with enable_lora=True (engine serve --enable-lora)"


class EngineLoras:
    """Adapters as the engine's request path sees them.

    Args:
        manager: the adapters' manager, None when LoRA is off (then every adapter is refused).
    """

    def __init__(self, manager: LoraManager | None) -> None:
        self.manager = manager

    def _manager(self) -> LoraManager:
        if self.manager is None:
            raise InvalidRequestError(NOT_ENABLED, param="lora_request")
        return self.manager

    def add(self, request: LoRARequest) -> bool:
        """Register (and load) an adapter; False when it already is. See :meth:`LoraManager.add`."""
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(request).__name__}", param="lora_request")
        return self._manager().add(request)

    def remove(self, lora_id: int, running: Iterable[Sequence]) -> bool:
        """Forget an adapter; False when it was not registered.

        Raises:
            InvalidRequestError: a request still runs under it.
        """
        manager = self._manager()
        if any(seq.lora_id == lora_id and not seq.is_finished for seq in running):
            raise InvalidRequestError(f"LoRA adapter {lora_id} still has requests running; abort them first", param="lora_request")
        return manager.remove(lora_id)

    def list(self) -> list[LoRARequest]:
        return [] if self.manager is None else self.manager.list()

    def tag(self, sequences: Iterable[Sequence], request: LoRARequest | None) -> None:
        """Put a request's adapter on its sequences (registering it first if new)."""
        if request is None:
            return
        self.add(request)
        key = self._manager().cache_key(request.lora_int_id)
        for seq in sequences:
            seq.lora_id, seq.lora_key = request.lora_int_id, key

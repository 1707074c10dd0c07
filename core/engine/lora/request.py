"""The request-side name of an adapter (the leading engine's ``LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs under.

    Args:
        lora_name: the adapter's name (what the server's ``model`` field selects it by).
        lora_int_id: a positive id, unique among the engine's adapters; requests under the same id share
            the adapter's device slot and its cached prompt blocks.
        lora_path: a PEFT folder (``adapter_config.json`` and ``adapter_model.safetensors``).
        base_model_name: the base model it was trained on, as ``/v1/models`` reports it (optional).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

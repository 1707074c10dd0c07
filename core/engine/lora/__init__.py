"""Multi-LoRA serving: adapters in the PEFT format over one base model, batched together.

``LoRARequest`` names an adapter for a request; :class:`~engine.lora.manager.LoraManager` keeps the
adapters the engine knows, a host cache of their tensors and the device slots they run from.
"""

from __future__ import annotations

from engine.lora.config import LoRAConfig
from engine.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]

"""LoRA settings of an engine (``LLM(enable_lora=True, max_loras=..., ...)``, ``engine serve --enable-lora``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LoRAConfig(BaseModel):
    """How many adapters the engine holds and how large they may be.

    Attributes:
        max_loras: device slots: the most distinct adapters in one step (the scheduler keeps the rest
            waiting).
        max_lora_rank: the largest rank an adapter may have; every slot is sized for it.
        max_cpu_loras: adapters kept loaded in host memory (least recently used evicted, reloaded from
            their folder when needed again); None: ``max_loras``. At least ``max_loras``.
    """

    model_config = ConfigDict(extra="forbid")

    max_loras: int = Field(1, ge=1, le=256)
    max_lora_rank: int = Field(16, ge=1, le=512)
    max_cpu_loras: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_cpu_cache(self) -> LoRAConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        return self

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

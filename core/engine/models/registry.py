"""Architecture name -> model class; plugins may add architectures through a hook."""

from __future__ import annotations

from typing import Any

from engine.models.llama import LlamaForCausalLM

_BUILTIN: tuple[tuple[str, type], ...] = (
    ("LlamaForCausalLM", LlamaForCausalLM),
    ("MistralForCausalLM", LlamaForCausalLM),
    ("Qwen2ForCausalLM", LlamaForCausalLM),
)


def model_registry(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The built-in architectures plus ``extra`` (from plugins)."""
    registry: dict[str, Any] = dict(_BUILTIN)
    registry.update(extra or {})
    return registry


def supported_architectures(extra: dict[str, Any] | None = None) -> list[str]:
    return sorted(model_registry(extra))

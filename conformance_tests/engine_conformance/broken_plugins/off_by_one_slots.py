"""Broken: keys and values are stored one slot after the one the slot mapping names."""

from __future__ import annotations

from typing import Any

from engine.interfaces.attention import AttentionBackend
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class OffByOneAttention(ReferenceAttentionBackend):
    def write_kv(self, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        last = kv_cache.shape[1] * kv_cache.shape[2] - 1
        shifted = (slot_mapping + 1).clamp(max=last)
        shifted[slot_mapping < 0] = -1
        super().write_kv(key, value, kv_cache, shifted)


class OffByOneSlotsPlatform(ReferencePlatform):
    name = "broken-slots"

    def make_attention_backend(self) -> AttentionBackend:
        return OffByOneAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [OffByOneSlotsPlatform]

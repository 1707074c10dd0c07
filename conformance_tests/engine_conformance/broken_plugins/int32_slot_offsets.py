"""Broken: ``write_kv`` computes a slot's element offset ``slot * kv_heads * head_dim`` in int32.

Imitates the store-side twin of the paged-attention overflow: pools up to 2**31 elements are written
right; in a larger pool, keys and values of the top blocks land in wrapped, low slots.
"""

from __future__ import annotations

from typing import Any

from engine.interfaces.attention import AttentionBackend
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class Int32SlotAttention(ReferenceAttentionBackend):
    def write_kv(self, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        per_slot = kv_cache.shape[3] * kv_cache.shape[4]
        wrapped = (slot_mapping * per_slot) % 2**31 // per_slot  # the int32 product, wrapped
        wrapped[slot_mapping < 0] = -1
        super().write_kv(key, value, kv_cache, wrapped)


class Int32SlotsPlatform(ReferencePlatform):
    name = "broken-int32-slots"

    def make_attention_backend(self) -> AttentionBackend:
        return Int32SlotAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [Int32SlotsPlatform]

"""Broken: ``write_kv`` writes padding rows (slot -1) into the cache's last slot, for bfloat16 caches.

Imitates a bf16 store kernel that indexes with the raw slot, so -1 wraps to the end of the pool (the
float32 kernel checks ``slot < 0``): the last slot of the last block, which belongs to some sequence,
is overwritten by a padding row's garbage.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class PaddingWritingAttention(ReferenceAttentionBackend):
    def write_kv(self, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        if kv_cache.dtype != torch.bfloat16:
            super().write_kv(key, value, kv_cache, slot_mapping)
            return
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        super().write_kv(key, value, kv_cache, slot_mapping % num_slots)  # -1 becomes the last slot


class PaddingSlotsPlatform(ReferencePlatform):
    name = "broken-padding-slots"

    def make_attention_backend(self) -> AttentionBackend:
        return PaddingWritingAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [PaddingSlotsPlatform]

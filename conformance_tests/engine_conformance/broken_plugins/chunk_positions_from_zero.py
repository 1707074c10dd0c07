"""Broken: the prefill path numbers a chunk's queries from 0, as if there were no cached prefix.

Imitates a prefill kernel written for whole prompts and reused for chunked prefill: its causal mask
uses ``query_len`` as the context length, so a chunk attends only to the first ``query_len`` keys of the
sequence. Fresh prompts (query length = context length) and decode rows are right.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class ChunkFromZeroAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        lens = [
            q if q > 1 else n for q, n in zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
        ]
        return super().forward(query, key, value, kv_cache, dataclasses.replace(metadata, seq_lens_cpu=lens))


class ChunkFromZeroPlatform(ReferencePlatform):
    name = "broken-chunk-positions"

    def make_attention_backend(self) -> AttentionBackend:
        return ChunkFromZeroAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [ChunkFromZeroPlatform]

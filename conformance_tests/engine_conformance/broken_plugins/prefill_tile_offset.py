"""Broken: a tiled prefill forgets the tile's row offset in its causal mask past the first 64 query rows.

Imitates a prefill kernel that tiles queries 64 rows at a time and computes each row's position from
its index inside the tile: rows 64 and on of a sequence see 64 keys fewer than they should. Every
prompt of at most 64 tokens is right, so short tests pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"

TILE = 64


class TiledPrefillAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        out = super().forward(query, key, value, kv_cache, metadata)
        start = 0
        for seq, (q_len, ctx) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
            if q_len > TILE:
                rows = slice(start + TILE, start + q_len)
                # the later tiles as if their rows sat TILE positions earlier
                tail = dataclasses.replace(
                    metadata,
                    query_lens_cpu=[q_len - TILE],
                    seq_lens_cpu=[ctx - TILE],
                    block_tables=metadata.block_tables[seq : seq + 1],
                    slot_mapping=metadata.slot_mapping[rows],
                    max_query_len=q_len - TILE,
                    max_seq_len=ctx - TILE,
                )
                out[rows] = super().forward(query[rows], key[rows], value[rows], kv_cache, tail)
            start += q_len
        return out


class PrefillTilePlatform(ReferencePlatform):
    name = "broken-prefill-tile"

    def make_attention_backend(self) -> AttentionBackend:
        return TiledPrefillAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [PrefillTilePlatform]

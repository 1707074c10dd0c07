"""Broken: the decode path takes the first ``n`` sequences as decodes, where ``n`` counts query length 1.

Imitates a backend that splits a continuous-batching step by counting single-token sequences and assumes
they lead the batch (vLLM's ``num_decodes`` convention) without checking: a one-token prompt chunk later
in the batch makes an earlier chunk be run as a decode (its first row attends as the last position, its
other rows are never written). Pure decode, pure prefill, and batches in the expected order are right.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class LeadingDecodesAttention(ReferenceAttentionBackend):
    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        out = super().forward(query, key, value, kv_cache, metadata)
        num_decodes = sum(q == 1 for q in metadata.query_lens_cpu)
        start = 0
        for seq, (q_len, ctx) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
            if seq < num_decodes and q_len > 1:
                # run as a decode: one row, attending as the context's last position; the rest untouched
                row = slice(start, start + 1)
                as_decode = dataclasses.replace(
                    metadata,
                    query_lens_cpu=[1],
                    seq_lens_cpu=[ctx],
                    block_tables=metadata.block_tables[seq : seq + 1],
                    slot_mapping=torch.full_like(metadata.slot_mapping[row], -1),
                    max_query_len=1,
                    max_seq_len=ctx,
                )
                out[row] = super().forward(query[row], key[row], value[row], kv_cache, as_decode)
                out[start + 1 : start + q_len] = 0
            start += q_len
        return out


class LeadingDecodesPlatform(ReferencePlatform):
    name = "broken-decode-order"

    def make_attention_backend(self) -> AttentionBackend:
        return LeadingDecodesAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [LeadingDecodesPlatform]

"""Broken: under a sliding window, keys in blocks wholly before the window are read without the window mask.

Imitates a kernel that masks the window only inside the block holding the window's edge, assuming the
blocks before it are never visited: but it still walks the whole block table, so the blocks the engine
released (whose table entries now point at another sequence's block) reach the softmax unmasked.
Windows that have not yet left a whole block behind are right.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceAttentionBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class UnmaskedReleasedBlocksAttention(ReferenceAttentionBackend):
    """The reference loop with the window mask applied only from the edge block on."""

    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        if metadata.sliding_window is None:
            return super().forward(query, key, value, kv_cache, metadata)
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        bs, window = metadata.block_size, metadata.sliding_window
        start = 0
        for seq, (q_len, ctx) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
            ids = self.sequence_block_ids(metadata, seq, -(-ctx // bs))
            keys = kv_cache[0].index_select(0, ids).flatten(0, 1)[:ctx].float()
            values = kv_cache[1].index_select(0, ids).flatten(0, 1)[:ctx].float()
            group = query.shape[1] // keys.shape[1]
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            q = query[start : start + q_len].float()
            scores = torch.einsum("qhd,khd->hqk", q, keys) * metadata.scale
            if metadata.logits_soft_cap is not None:
                scores = metadata.logits_soft_cap * torch.tanh(scores / metadata.logits_soft_cap)
            q_pos = torch.arange(ctx - q_len, ctx, device=query.device).unsqueeze(1)
            k_pos = torch.arange(ctx, device=query.device).unsqueeze(0)
            edge_block = (q_pos - window + 1).clamp(min=0) // bs
            in_window = (k_pos > q_pos - window) | (k_pos // bs < edge_block)  # earlier blocks: unmasked
            allowed = (k_pos <= q_pos) & in_window if metadata.causal else in_window
            probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
            out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
            start += q_len
        return out


class ReleasedBlocksPlatform(ReferencePlatform):
    name = "broken-released-blocks"

    def make_attention_backend(self) -> AttentionBackend:
        return UnmaskedReleasedBlocksAttention()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [ReleasedBlocksPlatform]

"""Plain torch backends that implement every interface correctly and slowly.

A new plugin starts from these (``engine plugin new`` scaffolds a platform that uses them) and replaces
one piece at a time with its own kernels, re-running conformance after each step. They run on any torch
device, in float32 or narrower dtypes, with every attention feature.

Cache layout: one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (keys, then
values); the block pool is :class:`~engine_plugin_sdk.torch_block_cache.TorchBlockCache`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.interfaces.gemm import GemmBackend, QuantizedWeight
from engine_plugin_sdk.torch_block_cache import TorchBlockCache

#: the dim of the reference cache layout that indexes blocks
BLOCK_DIM = 1


class ReferenceAttentionBackend(AttentionBackend):
    """Gathers each sequence's blocks by its block table and attends in float32.

    Honours every field of :class:`AttentionMetadata`: causal or not (``causal=False``, the encoder
    case), sliding window (symmetric in a non-causal step), soft-cap and sinks, in any combination.
    """

    supported_block_sizes: tuple[int, ...] = (8, 16, 32)
    supported_head_sizes: tuple[int, ...] = (64, 80, 128, 256)

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def write_kv(self, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        if slots.numel() == 0:
            return
        # flatten (block, offset) into slots; a view, so index_copy_ writes the cache itself
        key_slots = kv_cache[0].flatten(0, 1)
        value_slots = kv_cache[1].flatten(0, 1)
        key_slots.index_copy_(0, slots, key[keep].to(kv_cache.dtype))
        value_slots.index_copy_(0, slots, value[keep].to(kv_cache.dtype))

    def sequence_block_ids(self, metadata: AttentionMetadata, seq: int, num_blocks: int) -> torch.Tensor:
        """Physical blocks holding the first ``num_blocks`` logical blocks of sequence ``seq``."""
        return metadata.block_tables[seq, :num_blocks].long()

    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        num_heads = query.shape[1]
        out = torch.empty_like(query)
        start = 0
        for seq, (q_len, ctx) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
            ids = self.sequence_block_ids(metadata, seq, -(-ctx // metadata.block_size))
            keys = kv_cache[0].index_select(0, ids).flatten(0, 1)[:ctx].float()
            values = kv_cache[1].index_select(0, ids).flatten(0, 1)[:ctx].float()
            group = num_heads // keys.shape[1]
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            q = query[start : start + q_len].float()
            scores = torch.einsum("qhd,khd->hqk", q, keys) * metadata.scale
            if metadata.logits_soft_cap is not None:
                scores = metadata.logits_soft_cap * torch.tanh(scores / metadata.logits_soft_cap)
            q_pos = torch.arange(ctx - q_len, ctx, device=query.device).unsqueeze(1)
            k_pos = torch.arange(ctx, device=query.device).unsqueeze(0)
            allowed = torch.ones(q_len, ctx, dtype=torch.bool, device=query.device)
            if metadata.causal:
                allowed &= k_pos <= q_pos
            if metadata.sliding_window is not None:
                allowed &= k_pos > q_pos - metadata.sliding_window
                if not metadata.causal:  # a non-causal window is symmetric
                    allowed &= k_pos < q_pos + metadata.sliding_window
            scores = scores.masked_fill(~allowed, -math.inf)
            if metadata.sinks is not None:  # one more softmax term per head, with no value
                sink = metadata.sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :ctx]
            else:
                probs = torch.softmax(scores, dim=-1)
            out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
            start += q_len
        return out

    def gather_kv(self, kv_cache: Any, block_ids: list[int]) -> tuple[Any, Any]:
        ids = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        return kv_cache[0].index_select(0, ids).flatten(0, 1), kv_cache[1].index_select(0, ids).flatten(0, 1)


class ReferenceGemmBackend(GemmBackend):
    """``torch.nn.functional.linear``; quantized weights are dequantized once at load time."""

    supported_quant_schemes: frozenset[str] = frozenset()

    def prepare_weight(self, weight: Any, dtype: Any) -> Any:
        if isinstance(weight, QuantizedWeight):
            if weight.dequantize is None:
                raise ValueError(
                    f"quantized weight of scheme {weight.scheme!r} has no dequantize() to fall back to"
                )
            weight = torch.as_tensor(weight.dequantize())
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise ValueError(
                f"cannot prepare a weight of type {type(weight).__name__}; expected a float tensor"
            )
        return weight.to(dtype).contiguous()

    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> Any:
        return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


#: the reference platform's block pool is the SDK's one torch pool (the name is kept for plugins that use it)
ReferenceBlockCache = TorchBlockCache

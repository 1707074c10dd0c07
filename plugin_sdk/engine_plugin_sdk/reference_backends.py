"""Plain torch backends that implement every interface correctly and slowly.

A new plugin starts from these (``engine plugin new`` scaffolds a platform that uses them) and replaces
one piece at a time with its own kernels, re-running conformance after each step. They run on any torch
device, in float32 or narrower dtypes, with every attention feature.

Cache layout: one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (keys, then
values).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine.interfaces.gemm import GemmBackend, QuantizedWeight

#: the dim of the reference cache layout that indexes blocks
BLOCK_DIM = 1


class ReferenceAttentionBackend(AttentionBackend):
    """Gathers each sequence's blocks by its block table and attends in float32."""

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
            probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
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


class ReferenceBlockCache(BlockCache):
    """Per-layer cache tensors on one torch device, host copies for swapping.

    Args:
        spec: cache geometry; ``spec.dtype`` is a torch dtype.
        num_blocks: device blocks.
        attention: fixes each layer's tensor shape.
        device: torch device of the pool.
        num_host_blocks: host blocks for swapping (default: as many as on the device).
        block_dim: which dim of the attention backend's layout indexes blocks.
    """

    supports_swap = True

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        attention: AttentionBackend,
        device: Any = "cpu",
        num_host_blocks: int | None = None,
        block_dim: int = BLOCK_DIM,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_dim = block_dim
        shape = attention.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self._num_host_blocks = num_host_blocks or num_blocks
        self._host_caches: list[torch.Tensor] | None = None

    def _host(self) -> list[torch.Tensor]:
        # allocated on first swap: most runs never preempt by swapping
        if self._host_caches is None:
            self._host_caches = []
            for cache in self.kv_caches:
                shape = list(cache.shape)
                shape[self.block_dim] = self._num_host_blocks
                self._host_caches.append(torch.zeros(shape, dtype=cache.dtype, device="cpu"))
        return self._host_caches

    @staticmethod
    def _split(pairs: list[tuple[int, int]], device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        return src, dst

    def copy_blocks(self, src_to_dst: list[tuple[int, int]]) -> None:
        if not src_to_dst:
            return
        for cache in self.kv_caches:
            src, dst = self._split(src_to_dst, cache.device)
            cache.index_copy_(self.block_dim, dst, cache.index_select(self.block_dim, src))

    def swap_out(self, device_to_host: list[tuple[int, int]]) -> None:
        if not device_to_host:
            return
        for cache, host in zip(self.kv_caches, self._host(), strict=True):
            src, _ = self._split(device_to_host, cache.device)
            _, dst = self._split(device_to_host, "cpu")
            host.index_copy_(self.block_dim, dst, cache.index_select(self.block_dim, src).cpu())

    def swap_in(self, host_to_device: list[tuple[int, int]]) -> None:
        if not host_to_device:
            return
        for cache, host in zip(self.kv_caches, self._host(), strict=True):
            src, _ = self._split(host_to_device, "cpu")
            _, dst = self._split(host_to_device, cache.device)
            cache.index_copy_(self.block_dim, dst, host.index_select(self.block_dim, src).to(cache.device))

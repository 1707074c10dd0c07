"""Paged attention on the NPU: the KV write through reshape-and-cache, attention through the fused op.

All kernel calls go through the kernel module the backend was built with (torch_npu's, or the CPU
reference substitute in tests); this class only lays out tensors and interprets results.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from engine_plugin_ascend.attention_plan import (
    NON_CAUSAL_REFUSED,
    SPARSE_RIGHT_DOWN_CAUSAL,
    AscendStepPlan,
    AttentionLaunch,
    build_step_plan,
)
from engine_plugin_ascend.layout import (
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    as_page_attention_kv,
    causal_mask,
    check_geometry,
    kv_cache_shape,
    split_caches,
)
from engine_plugin_sdk import AttentionBackend, AttentionMetadata

#: where the step plan is cached inside ``AttentionMetadata.extras``
PLAN_KEY = "ascend_attention_plan"
ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
INT32_MAX = 2**31 - 1


class AscendAttentionBackend(AttentionBackend):
    """Mixed prefill / chunked-prefill / decode batches over a ``[2, blocks, block_size, kv_heads, d]`` cache.

    Args:
        kernels: the kernel module (:mod:`engine_plugin_ascend.npu_kernels` or its reference substitute).
    """

    supported_block_sizes = SUPPORTED_BLOCK_SIZES
    supported_head_sizes = SUPPORTED_HEAD_SIZES

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels
        self._masks: dict[torch.device, torch.Tensor] = {}

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def write_kv(self, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        slots = torch.as_tensor(slot_mapping).reshape(-1)
        if slots.numel() != key.shape[0]:
            raise ValueError(f"slot_mapping has {slots.numel()} entries for {key.shape[0]} tokens")
        key_cache, value_cache = split_caches(kv_cache)
        self._store(key, value, key_cache, value_cache, slots.to(device=key_cache.device, dtype=torch.int32))

    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata) -> Any:
        if metadata.sinks is not None:
            raise NotImplementedError("the Ascend plugin's attention has no attention sinks (attention_sinks is not claimed)")
        if not metadata.causal:
            # checked here as well as in the plan: a model that copies a causal step's metadata with
            # causal=False shares its extras, and so the causal plan cached there
            raise NotImplementedError(NON_CAUSAL_REFUSED)
        key_cache, value_cache = split_caches(kv_cache)
        self._check(query, key, value, key_cache, metadata)
        plan = self._step_plan(metadata, query.shape[0])
        self._store(key, value, key_cache, value_cache, plan.slot_indices)
        if len(plan.launches) == 1 and plan.launches[0].rows is None:
            return self._attend(query, key_cache, value_cache, plan.launches[0], metadata)
        out = torch.empty_like(query)
        for launch in plan.launches:
            result = self._attend(query, key_cache, value_cache, launch, metadata)
            if launch.rows is None:
                out.copy_(result)
            else:
                out.index_copy_(0, launch.rows, result)
        return out

    def gather_kv(self, kv_cache: Any, block_ids: list[int]) -> tuple[Any, Any]:
        key_cache, value_cache = split_caches(kv_cache)
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=key_cache.device)
        return key_cache.index_select(0, ids).flatten(0, 1), value_cache.index_select(0, ids).flatten(0, 1)

    # --- internals -------------------------------------------------------------------------------

    def _store(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        if key_cache.shape[0] * key_cache.shape[1] > INT32_MAX:
            raise ValueError("the cache has more slots than int32 slot indices can address")
        # the kernel takes contiguous rows already in the cache dtype
        key = key.to(key_cache.dtype).contiguous()
        value = value.to(value_cache.dtype).contiguous()
        self.kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)

    @staticmethod
    def _check(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape:
            raise ValueError(
                "query, key and value must be [num_tokens, heads, head_dim], key and value alike"
            )
        if query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
            raise ValueError(
                f"query {tuple(query.shape)} and key {tuple(key.shape)} disagree on tokens or head_dim"
            )
        check_geometry(metadata.block_size, query.shape[2], query.shape[1], key.shape[1])
        if query.dtype not in ATTENTION_DTYPES:
            raise ValueError(f"attention on npu runs in float16 or bfloat16, not {query.dtype}")
        if key_cache.dtype != query.dtype:
            raise ValueError(
                f"the KV cache dtype {key_cache.dtype} must equal the query dtype {query.dtype} on npu"
            )
        if tuple(key_cache.shape[1:]) != (metadata.block_size, key.shape[1], key.shape[2]):
            raise ValueError(
                f"kv_cache blocks {tuple(key_cache.shape[1:])} do not match block_size {metadata.block_size}, "
                f"{key.shape[1]} kv heads, head_dim {key.shape[2]}"
            )

    def _step_plan(self, metadata: AttentionMetadata, num_tokens: int) -> AscendStepPlan:
        # one metadata object serves every layer of a step: plan once, reuse while its tensors are the same
        plan = metadata.extras.get(PLAN_KEY)
        sources = (metadata.block_tables, metadata.seq_lens, metadata.slot_mapping)
        if isinstance(plan, AscendStepPlan) and all(
            a is b for a, b in zip(plan.sources, sources, strict=True)
        ):
            return plan
        plan = build_step_plan(metadata, num_tokens)
        metadata.extras[PLAN_KEY] = plan
        return plan

    def _mask(self, device: torch.device) -> torch.Tensor:
        mask = self._masks.get(device)
        if mask is None:
            mask = self._masks[device] = causal_mask(device)
        return mask

    def _attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        launch: AttentionLaunch,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The launch's output rows ``[len(rows), num_heads, head_dim]`` in launch order."""
        _, num_heads, head_dim = query.shape
        q = query if launch.rows is None else query.index_select(0, launch.rows)
        if launch.padded_rows is None:
            q4 = q.contiguous().view(launch.batch, 1, num_heads, head_dim)
        else:
            # zeros, not garbage, in the padding: the kernel reads whole [S, N, D] tiles
            padded = query.new_zeros(launch.batch * launch.max_query_len, num_heads, head_dim)
            padded.index_copy_(0, launch.padded_rows, q)
            q4 = padded.view(launch.batch, launch.max_query_len, num_heads, head_dim)
        mask = self._mask(query.device) if launch.sparse_mode == SPARSE_RIGHT_DOWN_CAUSAL else None
        result, _ = self.kernels.fused_infer_attention_score(
            q4,
            as_page_attention_kv(key_cache),
            as_page_attention_kv(value_cache),
            block_table=launch.block_table,
            actual_seq_lengths=launch.query_lens,
            actual_seq_lengths_kv=launch.seq_lens,
            atten_mask=mask,
            num_heads=num_heads,
            num_key_value_heads=key_cache.shape[2],
            scale=metadata.scale,
            input_layout="BSND",
            sparse_mode=launch.sparse_mode,
            block_size=metadata.block_size,
        )
        flat = result.reshape(launch.batch * launch.max_query_len, num_heads, head_dim)
        return flat if launch.padded_rows is None else flat.index_select(0, launch.padded_rows)

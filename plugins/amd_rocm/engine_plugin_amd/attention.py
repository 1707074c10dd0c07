"""Paged attention on ROCm: the SDK's Triton backend, launched with the AMD parameter table.

The implementation (cache layout ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, prefill /
decode dispatch, input checks) is :mod:`engine_plugin_sdk.gpu.attention`; the tuning comes from
:mod:`engine_plugin_amd.tuning` through the platform.
"""

from __future__ import annotations

from engine_plugin_sdk.gpu.attention import TritonPagedAttentionBackend, check_inputs, stream_capturing

__all__ = ["RocmTritonAttentionBackend", "check_inputs", "stream_capturing"]


class RocmTritonAttentionBackend(TritonPagedAttentionBackend):
    """Triton paged attention (online softmax, GQA, sliding window, soft-cap) for fp32 / fp16 / bf16.

    Args:
        tuning: launch parameters of the target (see :mod:`engine_plugin_amd.tuning`).
    """

    platform_name = "rocm"

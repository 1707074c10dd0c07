"""Paged attention on NVIDIA GPUs: the SDK's Triton backend with NVIDIA's launch table.

The implementation (cache layout, prefill / decode dispatch, input checks) is
:mod:`engine_plugin_sdk.gpu.attention`, shared with the ROCm plugin; the tuning comes from
:mod:`engine_plugin_nvidia.tuning` through the platform.
"""

from __future__ import annotations

from engine_plugin_sdk.gpu.attention import TritonPagedAttentionBackend, check_inputs, stream_capturing

__all__ = ["TritonAttentionBackend", "check_inputs", "stream_capturing"]


class TritonAttentionBackend(TritonPagedAttentionBackend):
    """Triton paged attention (online softmax, GQA, sliding window, soft-cap) for fp32 / fp16 / bf16.

    Args:
        tuning: the target's launch parameters.
    """

    platform_name = "cuda"

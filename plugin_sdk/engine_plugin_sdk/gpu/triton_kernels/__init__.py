"""Triton kernels shared by the GPU plugins (NVIDIA and AMD ROCm): import-light entry point.

The kernels depend on Triton and torch tensors only, never on a vendor's runtime API; each plugin picks
launch parameters for its target through :class:`KernelTuning`. Importing this package imports Triton,
so plugins import it inside their platform methods, not at module import.
"""

from __future__ import annotations

from engine_plugin_sdk.gpu.triton_kernels.launch import (
    INTERPRETER_TUNING,
    AttentionTiles,
    KernelTuning,
    next_power_of_2,
)
from engine_plugin_sdk.gpu.triton_kernels.launchers import (
    add_layer_norm,
    fused_add_rms_norm,
    gelu_tanh_and_mul,
    layer_norm,
    paged_decode,
    paged_prefill,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv,
)
from engine_plugin_sdk.gpu.triton_kernels.post_norm import post_norm_add_rms_norm
from engine_plugin_sdk.gpu.triton_kernels.token_bitmask import apply_token_bitmask

__all__ = [
    "INTERPRETER_TUNING",
    "AttentionTiles",
    "KernelTuning",
    "add_layer_norm",
    "apply_token_bitmask",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "layer_norm",
    "next_power_of_2",
    "paged_decode",
    "paged_prefill",
    "post_norm_add_rms_norm",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv",
]

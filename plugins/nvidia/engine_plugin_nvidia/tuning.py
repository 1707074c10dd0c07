"""The NVIDIA launch-parameter table for the shared Triton kernels."""

from __future__ import annotations

import os

from engine_plugin_sdk.gpu.triton_kernels.launch import INTERPRETER_TUNING, AttentionTiles, KernelTuning


def tuning_for_device(interpret: bool) -> KernelTuning:
    """Launch parameters for GPU 0, or the interpreter's small tiles.

    Hopper and Ampere have room for 64x64 prefill tiles at head size 128 with two pipeline stages;
    older parts get smaller tiles. Hopper and later launch with programmatic dependent launch unless
    ``ENGINE_NVIDIA_PDL=0``.
    """
    if interpret:
        return INTERPRETER_TUNING
    import torch

    props = torch.cuda.get_device_properties(0)
    major = props.major
    if major >= 8:
        return KernelTuning(
            num_compute_units=props.multi_processor_count,
            prefill_small_head=AttentionTiles(64, 64, 4, 3 if major >= 9 else 2),
            prefill_large_head=AttentionTiles(64, 32, 8, 2),
            decode_block_n=64,
            decode_num_warps=4,
            decode_num_stages=2,
            # an FP8 cache's tiles hold half the bytes: twice the keys per iteration read it fastest
            # (H200, 1024 sequences x 640 tokens, benchmarks/nvidia_h200_fp8.py: 0.523 ms against 0.566
            # with the bf16 tiles and 0.612 over a bf16 cache)
            decode_fp8=(128, 4, 2),
            # at head size 256 (Gemma) 64 keys of 256 per tile is too much for 4 warps: 32 keys a step
            # read faster (H200, Gemma-2-9B batch-1 decode 191.5 -> 203.9 tok/s; Qwen3-8B's head of 128
            # gained nothing from it; benchmarks/results/nvidia_h200_session16_decode_tiles.json)
            decode_large_head=(32, 4, 2),
            # over an FP8 cache the decode kernel is bound by its softmax and addressing, not its bytes: two KV
            # heads a program share them (H100, 1,008 x 560 tokens with the step's KV write and rotary: 0.579 ms
            # for one head against 0.546 for two; W8A8 + FP8 KV offline 13,430 -> 13,770 tok/s;
            # benchmarks/nvidia_h200_decode_kernel_ab.sh); large batches only (decode_kv_heads)
            decode_paired_fp8=(64, 4, 2) if major >= 9 else None,
            use_pdl=major >= 9 and os.environ.get("ENGINE_NVIDIA_PDL", "1").strip() != "0",
        )
    return KernelTuning(
        num_compute_units=props.multi_processor_count,
        prefill_small_head=AttentionTiles(32, 32, 4, 1),
        prefill_large_head=AttentionTiles(16, 32, 4, 1),
        decode_block_n=32,
        decode_num_stages=1,
    )

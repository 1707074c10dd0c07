"""Deliberately wrong plugins, one bug each, that the suite must catch (core/tests/test_sdk_broken_plugins.py).

Each module is a complete plugin built on the reference platform with one piece broken; register it
in-process (``--plugin-module engine_conformance.broken_plugins.<name>``) and select ``--device`` by
its platform name. :data:`EXPECTED_FAILURES` maps each to the capability that must fail.
"""

from __future__ import annotations

#: module name -> (device name, capability that must be reported as failing)
EXPECTED_FAILURES = {
    "ignores_block_table": ("broken-block-table", "attention.decode"),
    "off_by_one_slots": ("broken-slots", "kv_write.float32"),
    "gemm_drops_bias": ("broken-bias", "gemm.float32"),
    "stale_graph_inputs": ("broken-graph", "graph_capture"),
    "fake_fp8": ("broken-fp8", "gemm.quant.fp8_e4m3"),
    "ignores_scale": ("broken-scale", "attention.matrix.float32.float32.decode.scale"),
    "bf16_decode_drops_last_key": ("broken-bf16-decode", "attention.matrix.bfloat16.bfloat16.decode.plain"),
    "prefill_tile_offset": ("broken-prefill-tile", "attention.long.prefill"),
    "window_block_multiple": (
        "broken-window-edge",
        "attention.matrix.float32.float32.decode.window_released",
    ),
    "soft_cap_prefill_only": ("broken-soft-cap", "attention.matrix.float32.float32.decode.soft_cap"),
    "gqa_head_modulo": ("broken-gqa-heads", "attention.gqa"),
    "chunk_positions_from_zero": ("broken-chunk-positions", "attention.chunked_prefill"),
    "head_dim_truncated": ("broken-head-dim", "attention.head_size.256"),
    "int32_block_offsets": ("broken-int32-offsets", "attention.large_block_index"),
    "window_reads_released_blocks": ("broken-released-blocks", "attention.sliding_window.released_blocks"),
    "norm_padded_width": ("broken-norm-width", "ops.rms_norm.widths"),
    "greedy_pick_last_tie": ("broken-greedy-ties", "ops.greedy_pick.ties"),
    "rotary_ignores_strides": ("broken-rotary-strides", "ops.rotary_embedding.strided"),
    "silu_ignores_strides": ("broken-silu-strides", "ops.silu_and_mul.strided"),
    "layer_norm_uncentred": ("broken-layer-norm", "ops.layer_norm"),
    "add_layer_norm_drops_residual": ("broken-add-layer-norm", "ops.add_layer_norm"),
    "bitmask_msb_first": ("broken-bitmask", "ops.apply_token_bitmask"),
    "gelu_erf_not_tanh": ("broken-gelu", "ops.gelu_tanh_and_mul"),
    "quant_split_k_drops_tail": ("broken-split-k", "gemm.quant.int8.shapes"),
    "gemm_ignores_strides": ("broken-gemm-strides", "gemm.float32.shapes"),
    "copy_blocks_groups_of_four": ("broken-block-copy", "block_cache.copy"),
    "swap_assumes_sorted": ("broken-swap", "block_cache.swap"),
    "padding_slots_written": ("broken-padding-slots", "kv_write.bfloat16"),
    "decode_rows_assumed_leading": ("broken-decode-order", "attention.decode_rows_first"),
    "gqa_group_padded": ("broken-gqa-group", "attention.matrix.float32.float32.decode.gqa"),
    "residual_store_outside_view": ("broken-residual-store", "ops.fused_add_rms_norm.strided"),
    "int32_slot_offsets": ("broken-int32-slots", "kv_write.large_block_index"),
    "greedy_pick_reads_padding": ("broken-greedy-padding", "ops.greedy_pick"),
    "all_gather_rank_order": ("broken-all-gather", "distributed.all_gather"),
    "collectives_baked_into_graphs": ("broken-graph-collectives", "distributed.graph_capture"),
    "moe_counts_a_repeated_expert_once": ("broken-moe-repeats", "moe.fused.float32"),
    "non_causal_masked_causally": ("broken-non-causal", "attention.non_causal"),
    "non_causal_window_ignored": ("broken-non-causal-window", "attention.non_causal.sliding_window"),
    "lora_scale_of_slot_zero": ("broken-lora-scale", "lora.add.mixed_ranks.float32"),
}

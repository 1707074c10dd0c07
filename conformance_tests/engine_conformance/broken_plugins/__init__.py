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
}

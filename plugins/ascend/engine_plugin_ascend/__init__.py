"""The Ascend NPU hardware plugin: device ``npu`` (alias ``ascend``), built on torch_npu.

The entry point is :mod:`engine_plugin_ascend.plugin`. Every call into torch_npu's kernels lives in
:mod:`engine_plugin_ascend.npu_kernels`; everything else (layouts, metadata, capability claims,
validation, graph buckets) is plain torch and runs on the CPU, where the test suite swaps that one
module for :mod:`engine_plugin_ascend.reference_kernels` (see :mod:`engine_plugin_ascend.kernel_switch`).
"""

from __future__ import annotations

__version__ = "0.1.0"

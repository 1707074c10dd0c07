"""The AMD ROCm hardware plugin: device ``rocm``; shared Triton paged attention, hipBLASLt / FP8 GEMM, HIP graphs.

The entry point is :mod:`engine_plugin_amd.plugin`; everything else is imported lazily so that
discovering the plugin never imports Triton nor initialises a GPU. The Triton kernels come from
``engine_plugin_nvidia.triton_kernels`` (vendor-neutral code; only that subpackage is imported), with
this plugin's own launch parameters from :mod:`engine_plugin_amd.tuning`.
"""

from __future__ import annotations

__version__ = "0.1.0"

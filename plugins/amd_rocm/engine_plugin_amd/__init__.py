"""The AMD ROCm hardware plugin: device ``rocm``; shared Triton paged attention, hipBLASLt / FP8 GEMM, HIP graphs.

The entry point is :mod:`engine_plugin_amd.plugin`; everything else is imported lazily so that
discovering the plugin never imports Triton nor initialises a GPU. The Triton kernels and the torch-GPU
glue (platform base, attention, GEMM, graphs, communicator) come from the SDK's vendor-neutral GPU layer,
:mod:`engine_plugin_sdk.gpu` (the ``engine[gpu]`` extra). This plugin adds its own detection, launch
parameters (:mod:`engine_plugin_amd.tuning`) and FP8 dtype.
"""

from __future__ import annotations

__version__ = "0.1.0"

"""The NVIDIA hardware plugin: device ``cuda``; Triton paged attention, cuBLAS / FP8 GEMM, CUDA graphs.

The entry point is :mod:`engine_plugin_nvidia.plugin`; classes live in their own modules and are
imported lazily so that discovering the plugin never imports Triton or initialises CUDA. The Triton
kernels and the torch-GPU glue come from the SDK's vendor-neutral GPU layer (:mod:`engine_plugin_sdk.gpu`,
shared with the AMD ROCm plugin); the modules here are NVIDIA's thin parameterisations of it.
"""

from __future__ import annotations

__version__ = "0.1.0"

"""The NVIDIA hardware plugin: device ``cuda``; Triton paged attention, cuBLAS / FP8 GEMM, CUDA graphs.

The entry point is :mod:`engine_plugin_nvidia.plugin`; classes live in their own modules and are
imported lazily so that discovering the plugin never imports Triton or initialises CUDA. The Triton
kernels in :mod:`engine_plugin_nvidia.triton_kernels` and the torch-GPU glue in
:mod:`engine_plugin_nvidia.gpu_common` use no CUDA-only API and are shared with other GPU plugins; the
modules beside them are NVIDIA's thin parameterisations.
"""

from __future__ import annotations

__version__ = "0.1.0"

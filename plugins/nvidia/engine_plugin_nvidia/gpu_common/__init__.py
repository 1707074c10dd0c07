"""Torch-GPU glue shared by the GPU plugins (NVIDIA here, AMD ROCm in ``engine_plugin_amd``).

ROCm builds of torch drive AMD GPUs through the same ``torch.cuda`` / ``torch.distributed`` API as CUDA
builds, so the platform logic, paged-attention backend, GEMM, graph capture and communicator are one
implementation, parameterised by what really differs per vendor: detection, launch tuning, the FP8
dtype, device-name hooks and labels. Nothing here uses a CUDA-only API.

Like :mod:`engine_plugin_nvidia.triton_kernels`, this subpackage is vendor-neutral and must never
import the NVIDIA platform (:mod:`engine_plugin_nvidia.platform`) or its registration
(:mod:`engine_plugin_nvidia.plugin`). This ``__init__`` imports nothing, so that importing
:mod:`.platform` stays cheap; the other modules import torch (and :mod:`.attention` Triton) and are
imported lazily by the platforms' factories.
"""

from __future__ import annotations

"""The vendor-neutral GPU layer: torch-on-GPU glue and Triton kernels shared by every GPU plugin.

ROCm builds of torch drive AMD GPUs through the same ``torch.cuda`` / ``torch.distributed`` API as CUDA
builds, so the platform logic, paged-attention backend, GEMM, graph capture and communicator are one
implementation here, parameterised by what really differs per vendor: detection, launch tuning, the FP8
dtype, names and labels. Nothing here uses a CUDA-only API. Needs the ``engine[gpu]`` extra (Triton).

- :mod:`.platform`: :class:`~.platform.TorchGpuPlatform`, the base a vendor platform subclasses; its
  typed factory hooks (``attention_backend_class()``, ``gemm_backend_class()``, ...) import the vendor's
  classes inside their bodies, so detection stays cheap;
- :mod:`.attention`: :class:`~.attention.TritonPagedAttentionBackend`;
- :mod:`.gemm`: :class:`~.gemm.TorchGemmBackend` with FP8 e4m3 (OCP and fnuz) weights;
- :mod:`.graph_capture`: :class:`~.graph_capture.TorchGraphCapture` (CUDA graphs, HIP graphs under ROCm);
- :mod:`.communicator`: :class:`~.communicator.TorchDistCommunicator` (NCCL, RCCL under ROCm);
- :mod:`.triton_kernels`: the Triton kernels and their launchers, which take a
  :class:`~.triton_kernels.launch.KernelTuning` of launch parameters chosen by the plugin.

This ``__init__`` imports nothing, so that importing :mod:`.platform` stays cheap; every other module
imports torch (and :mod:`.attention` and :mod:`.triton_kernels` Triton) and is imported lazily by the
platform's factories.
"""

from __future__ import annotations

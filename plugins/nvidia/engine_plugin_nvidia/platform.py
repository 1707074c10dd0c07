"""The CUDA platform: detection without touching the GPU, honest capabilities, memory, factories.

Everything vendor-neutral lives in the SDK's :class:`~engine_plugin_sdk.gpu.platform.TorchGpuPlatform`
(shared with the ROCm plugin, and so is the block pool: the SDK's ``TorchBlockCache`` with a pinned host
pool); this module adds what is NVIDIA's own: detection through a CUDA build of torch, claims by compute
capability, the FP8 producer ops, and the typed factory hooks naming the launch table of
:mod:`engine_plugin_nvidia.tuning` and this plugin's backend classes. Each hook imports its module in
its body, so importing this module (and detecting the platform) loads neither torch's CUDA runtime nor
Triton.

``ENGINE_NVIDIA_INTERPRET=1`` on a machine without an NVIDIA GPU makes the platform available in
*interpreter mode*: the same Triton kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set by the platform before the kernels are imported). That is how CI checks the
kernels against the conformance suite; it claims only float16 / float32 (``tl.dot`` on bfloat16 is wrong
in the interpreter) and no graphs or FP8.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine_plugin_sdk.gpu.platform import GPU_DTYPES, TorchGpuPlatform

if TYPE_CHECKING:
    from engine_plugin_nvidia.attention import TritonAttentionBackend
    from engine_plugin_nvidia.communicator import NcclCommunicator
    from engine_plugin_nvidia.gemm import CudaGemmBackend
    from engine_plugin_nvidia.graph_capture import CudaGraphCapture
    from engine_plugin_sdk.gpu.triton_kernels.launch import KernelTuning

INTERPRET_ENV = "ENGINE_NVIDIA_INTERPRET"
#: FP8 tensor cores arrived with Ada (8.9) and Hopper (9.0)
FP8_MIN_CAPABILITY = (8, 9)
BF16_MIN_CAPABILITY = (8, 0)


class CudaPlatform(TorchGpuPlatform):
    """One NVIDIA GPU (``cuda:0``) driven through torch, Triton and cuBLAS."""

    name = "cuda"
    aliases = ("nvidia", "gpu")
    priority = 100
    vendor = "NVIDIA"
    interpret_env = INTERPRET_ENV

    def __init__(self) -> None:
        super().__init__()
        self._capability: tuple[int, int] | None = None

    @classmethod
    def gpu_visible(cls) -> bool:
        return _has_cuda_gpu()

    @classmethod
    def unavailable_reason(cls) -> str:
        import torch

        if torch.version.cuda is None:
            return f"this torch build ({torch.__version__}) has no CUDA support"
        return "no NVIDIA GPU is visible (torch.cuda.device_count() is 0)"

    def compute_capability(self) -> tuple[int, int]:
        """GPU 0's compute capability, asked once (creates the CUDA context)."""
        if self._capability is None:
            import torch

            major, minor = torch.cuda.get_device_capability(0)
            self._capability = (major, minor)
        return self._capability

    def device_dtypes(self) -> tuple[str, ...]:
        return GPU_DTYPES if self.compute_capability() >= BF16_MIN_CAPABILITY else ("float16", "float32")

    def device_fp8_kv_cache_dtypes(self) -> tuple[str, ...]:
        # stored unscaled in the OCP e4m3 format; the Triton kernels convert it to fp16 natively on 8.9+,
        # and the block cache moves its bytes (checked on an H200)
        return ("float8_e4m3fn",) if self.device_fp8_dtype() else ()

    def device_fp8_dtype(self) -> str | None:
        # NVIDIA's FP8 tensor cores take the OCP format checkpoints store, so weights load unconverted
        return "float8_e4m3fn" if self.compute_capability() >= FP8_MIN_CAPABILITY else None

    def device_extra(self) -> dict[str, Any]:
        major, minor = self.compute_capability()
        return {"compute_capability": f"{major}.{minor}"}

    # --- typed factories: each imports its module here, never at module import ---------------------

    def kernel_tuning_for_device(self, interpret: bool) -> KernelTuning:
        from engine_plugin_nvidia.tuning import tuning_for_device

        return tuning_for_device(interpret)

    def attention_backend_class(self) -> type[TritonAttentionBackend]:
        from engine_plugin_nvidia.attention import TritonAttentionBackend

        return TritonAttentionBackend

    def gemm_backend_class(self) -> type[CudaGemmBackend]:
        from engine_plugin_nvidia.gemm import CudaGemmBackend

        return CudaGemmBackend

    def graph_capture_class(self) -> type[CudaGraphCapture]:
        from engine_plugin_nvidia.graph_capture import CudaGraphCapture

        return CudaGraphCapture

    def communicator_class(self) -> type[NcclCommunicator]:
        from engine_plugin_nvidia.communicator import NcclCommunicator

        return NcclCommunicator

    def step_overlap_attention_sms(self) -> int:
        # not measured yet (no device since the overlap was written): products keep every SM unless asked
        return _whole_number_env("ENGINE_NVIDIA_DBO_ATTENTION_SMS")

    def step_overlap_attention_priority(self) -> int:
        return _whole_number_env("ENGINE_NVIDIA_DBO_ATTENTION_PRIORITY")

    def default_max_num_batched_tokens(self) -> int | None:
        # H200, Llama-3-8B bf16, 256 streaming clients of 512 in / 256 out: 8,192-token steps served 9,641
        # output tok/s (TTFT p99 3.5 s) where the core's 2,048 and 4,096 gave about 7,300 (p99 3.8 s);
        # the interpreter runs the kernels on the CPU, where the core's default stays
        return None if self.interpret else 8192

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        overrides = super().op_overrides()
        if self.fp8_dtype():
            # the FP8 producers of W8A8 inputs need FP8 conversions: GPUs with FP8 units only (never the
            # interpreter, where fp8_dtype() is None); checked on an H200, so NVIDIA's platform offers them
            from engine_plugin_sdk.gpu.triton_kernels import fp8_launchers

            overrides["fused_add_rms_norm_fp8"] = fp8_launchers.fused_add_rms_norm_fp8
            overrides["silu_and_mul_fp8"] = fp8_launchers.silu_and_mul_fp8
        return overrides


#: ``interpreter_requested(environ=None)``: whether ``ENGINE_NVIDIA_INTERPRET=1`` is set
interpreter_requested = CudaPlatform.interpreter_requested


def _whole_number_env(name: str) -> int:
    """An integer environment variable, 0 when unset.

    Raises:
        ValueError: it is set to something else than a whole number.
    """
    value = os.environ.get(name, "0").strip()
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {value!r}") from None


def _has_cuda_gpu() -> bool:
    """An NVIDIA GPU is visible, asked without creating a CUDA context (torch counts through NVML)."""
    import torch

    if torch.version.cuda is None:  # CPU or ROCm build: not ours
        return False
    return torch.cuda.device_count() > 0

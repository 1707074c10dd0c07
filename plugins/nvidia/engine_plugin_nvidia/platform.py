"""The CUDA platform: detection without touching the GPU, honest capabilities, memory, factories.

``ENGINE_NVIDIA_INTERPRET=1`` on a machine without an NVIDIA GPU makes the platform available in
*interpreter mode*: the same Triton kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set by the platform before the kernels are imported). That is how CI checks the
kernels against the conformance suite; it claims only float16 / float32 (``tl.dot`` on bfloat16 is wrong
in the interpreter) and no graphs or FP8.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine.interfaces.gemm import GemmBackend
from engine.interfaces.graph_capture import EagerGraphCapture, GraphCapture
from engine.interfaces.platform import Capabilities, DetectResult, Platform

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine_plugin_nvidia.triton_kernels.launch import KernelTuning

INTERPRET_ENV = "ENGINE_NVIDIA_INTERPRET"
GPU_DTYPES = ("bfloat16", "float16", "float32")
#: interpreter: float32 first, so ``--dtype auto`` picks the exact one
INTERPRETER_DTYPES = ("float32", "float16")
BLOCK_SIZES = (8, 16, 32, 64)
HEAD_SIZES = (64, 80, 96, 128, 256)
FP8_SCHEME = "fp8_e4m3"
#: FP8 tensor cores arrived with Ada (8.9) and Hopper (9.0)
FP8_MIN_CAPABILITY = (8, 9)
BF16_MIN_CAPABILITY = (8, 0)
INTERPRETER_KV_CACHE_BYTES = 256 * 1024**2


def interpreter_requested(environ: Any = None) -> bool:
    """Whether the user asked for interpreter mode (``ENGINE_NVIDIA_INTERPRET=1``)."""
    env = os.environ if environ is None else environ
    return env.get(INTERPRET_ENV, "").strip() == "1"


class CudaPlatform(Platform):
    """One NVIDIA GPU (``cuda:0``) driven through torch, Triton and cuBLAS."""

    name = "cuda"
    aliases = ("nvidia", "gpu")
    priority = 100
    torch_device_type = "cuda"

    def __init__(self) -> None:
        self.interpret = interpreter_requested() and not _has_cuda_gpu()
        if self.interpret:
            # Triton decides interpreted or compiled when a kernel is defined: set it before our kernels load
            os.environ["TRITON_INTERPRET"] = "1"
            self.torch_device_type = "cpu"
        self._tuning: KernelTuning | None = None

    @classmethod
    def detect(cls) -> DetectResult:
        if importlib.util.find_spec("triton") is None:
            return DetectResult(False, "the triton package is not installed (pip install triton)")
        if _has_cuda_gpu():
            return DetectResult(True)
        if interpreter_requested():
            return DetectResult(True, "no NVIDIA GPU: Triton interpreter on the CPU (ENGINE_NVIDIA_INTERPRET=1)")
        import torch

        if torch.version.cuda is None:
            return DetectResult(False, f"this torch build ({torch.__version__}) has no CUDA support")
        return DetectResult(False, "no NVIDIA GPU is visible (torch.cuda.device_count() is 0)")

    def capabilities(self) -> Capabilities:
        if self.interpret:
            return Capabilities(
                dtypes=INTERPRETER_DTYPES,
                kv_cache_dtypes=INTERPRETER_DTYPES,
                block_sizes=BLOCK_SIZES,
                head_sizes=HEAD_SIZES,
                sliding_window=True,
                logits_soft_cap=True,
                swap=True,
                extra={"mode": "triton-interpreter"},
            )
        import torch

        capability = torch.cuda.get_device_capability(0)
        dtypes = GPU_DTYPES if capability >= BF16_MIN_CAPABILITY else ("float16", "float32")
        return Capabilities(
            dtypes=dtypes,
            kv_cache_dtypes=dtypes,
            block_sizes=BLOCK_SIZES,
            head_sizes=HEAD_SIZES,
            quant_schemes=(FP8_SCHEME,) if capability >= FP8_MIN_CAPABILITY else (),
            graph_capture=True,
            sliding_window=True,
            logits_soft_cap=True,
            swap=True,
            extra={"compute_capability": f"{capability[0]}.{capability[1]}"},
        )

    def validate(self, config: EngineConfig) -> list[str]:
        if config.dtype == "auto":
            config = config.model_copy(update={"dtype": self.capabilities().dtypes[0]})
        reasons = super().validate(config)
        if self.interpret and config.dtype == "bfloat16":
            reasons.append("bfloat16 does not run in the Triton interpreter (tl.dot on bfloat16 is wrong there)")
        return reasons

    def validate_head_size(self, head_dim: int) -> list[str]:
        """Reasons a model with this head size cannot run here (the engine checks this too)."""
        if head_dim in HEAD_SIZES:
            return []
        return [f"head size {head_dim} is not supported on {self.name} (supported: {list(HEAD_SIZES)})"]

    # --- memory ---------------------------------------------------------------------------------

    def total_memory_bytes(self) -> int:
        if self.interpret:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)

    def free_memory_bytes(self) -> int:
        if self.interpret:
            return min(self.total_memory_bytes(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
        import torch

        free, _ = torch.cuda.mem_get_info(0)
        return int(free)

    def default_kv_cache_bytes(self) -> int | None:
        return INTERPRETER_KV_CACHE_BYTES if self.interpret else None

    def synchronize(self) -> None:
        if not self.interpret:
            import torch

            torch.cuda.synchronize()

    def torch_device(self) -> Any:
        import torch

        return torch.device("cpu") if self.interpret else torch.device("cuda", 0)

    # --- factories --------------------------------------------------------------------------------

    def kernel_tuning(self) -> KernelTuning:
        """Launch parameters for this device (built once; reads the multiprocessor count)."""
        if self._tuning is None:
            from engine_plugin_nvidia.tuning import tuning_for_device

            self._tuning = tuning_for_device(self.interpret)
        return self._tuning

    def make_attention_backend(self) -> AttentionBackend:
        from engine_plugin_nvidia.attention import TritonAttentionBackend

        return TritonAttentionBackend(self.kernel_tuning())

    def make_gemm_backend(self) -> GemmBackend:
        from engine_plugin_nvidia.gemm import CudaGemmBackend

        fp8 = FP8_SCHEME in self.capabilities().quant_schemes
        return CudaGemmBackend(self.torch_device(), fp8=fp8)

    def make_block_cache(self, spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend) -> BlockCache:
        from engine_plugin_nvidia.block_cache import CudaBlockCache

        return CudaBlockCache(spec, num_blocks, attention, self.torch_device(), pin_host=not self.interpret)

    def make_graph_capture(self) -> GraphCapture:
        if self.interpret:
            return EagerGraphCapture()
        from engine_plugin_nvidia.graph_capture import CudaGraphCapture

        return CudaGraphCapture()

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        self.kernel_tuning()  # makes sure interpreter mode is set before the kernels are imported
        from engine_plugin_nvidia.triton_kernels import launchers

        return {
            "rms_norm": launchers.rms_norm,
            "fused_add_rms_norm": launchers.fused_add_rms_norm,
            "rotary_embedding": launchers.rotary_embedding,
            "silu_and_mul": launchers.silu_and_mul,
        }

    def make_communicator(self, world_size: int, rank: int, init_method: str) -> Any:
        """An NCCL communicator for tensor parallelism (see :mod:`engine_plugin_nvidia.communicator`)."""
        from engine_plugin_nvidia.communicator import NcclCommunicator

        return NcclCommunicator(world_size, rank, init_method)


def _has_cuda_gpu() -> bool:
    """An NVIDIA GPU is visible, asked without creating a CUDA context (torch counts through NVML)."""
    import torch

    if torch.version.cuda is None:  # CPU or ROCm build: not ours
        return False
    return torch.cuda.device_count() > 0

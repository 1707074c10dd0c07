"""The ROCm platform: detection without touching the GPU, honest capabilities, memory, factories.

A ROCm build of torch drives AMD GPUs through the ``torch.cuda`` API (HIP is exposed under that name),
so ``torch.cuda.is_available()`` is True there too: what tells ROCm from CUDA is ``torch.version.hip``.

``ENGINE_AMD_INTERPRET=1`` on a machine without an AMD GPU makes the platform available in
*interpreter mode*: the shared Triton kernels run on CPU tensors through Triton's interpreter with this
plugin's CDNA-shaped launch parameters. It claims float16 / float32 only (``tl.dot`` on bfloat16 is
wrong in the interpreter), no graphs and no FP8. Nothing here has run on AMD hardware yet.
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
    from engine_plugin_nvidia.triton_kernels.launch import KernelTuning

    from engine.config import EngineConfig

INTERPRET_ENV = "ENGINE_AMD_INTERPRET"
GPU_DTYPES = ("bfloat16", "float16", "float32")
#: interpreter: float32 first, so ``--dtype auto`` picks the exact one
INTERPRETER_DTYPES = ("float32", "float16")
BLOCK_SIZES = (8, 16, 32, 64)
HEAD_SIZES = (64, 80, 96, 128, 256)
FP8_SCHEME = "fp8_e4m3"
INTERPRETER_KV_CACHE_BYTES = 256 * 1024**2


def interpreter_requested(environ: Any = None) -> bool:
    """Whether the user asked for interpreter mode (``ENGINE_AMD_INTERPRET=1``)."""
    env = os.environ if environ is None else environ
    return env.get(INTERPRET_ENV, "").strip() == "1"


class RocmPlatform(Platform):
    """One AMD GPU (HIP device 0, ``torch.device("cuda", 0)`` under ROCm) driven through torch and Triton."""

    name = "rocm"
    aliases = ("amd", "hip")
    # below cuda: on a (rare) host with both, a CUDA build of torch cannot drive the AMD GPU anyway
    priority = 90
    torch_device_type = "cuda"

    def __init__(self) -> None:
        self.interpret = interpreter_requested() and not has_rocm_gpu()
        if self.interpret:
            # Triton decides interpreted or compiled when a kernel is defined: set it before the kernels load
            os.environ["TRITON_INTERPRET"] = "1"
            self.torch_device_type = "cpu"
        self._tuning: KernelTuning | None = None
        self._arch: str | None = None

    @classmethod
    def detect(cls) -> DetectResult:
        if importlib.util.find_spec("triton") is None:
            return DetectResult(False, "the triton package is not installed (ROCm wheels ship it as pytorch-triton-rocm)")
        if has_rocm_gpu():
            return DetectResult(True)
        if interpreter_requested():
            return DetectResult(True, "no AMD GPU: Triton interpreter on the CPU (ENGINE_AMD_INTERPRET=1)")
        import torch

        if torch.version.hip is None:
            build = "a CUDA" if torch.version.cuda is not None else "a CPU-only"
            return DetectResult(
                False, f"this torch build ({torch.__version__}) is {build} build without ROCm/HIP (torch.version.hip is None)"
            )
        return DetectResult(
            False,
            f"no AMD GPU is visible to this ROCm build (HIP {torch.version.hip}): torch.cuda.device_count() is 0 "
            "(check HIP_VISIBLE_DEVICES and access to /dev/kfd)",
        )

    def arch(self) -> str:
        """The base GPU architecture (``"gfx942"``), or ``"interpreter"``."""
        if self._arch is None:
            if self.interpret:
                self._arch = "interpreter"
            else:
                import torch

                from engine_plugin_amd.tuning import base_arch

                self._arch = base_arch(getattr(torch.cuda.get_device_properties(0), "gcnArchName", ""))
        return self._arch

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
                extra={"mode": "triton-interpreter", "launch_parameters": "cdna-interpreter"},
            )
        from engine_plugin_amd.tuning import fp8_dtype_name, wavefront_size

        arch = self.arch()
        fp8 = fp8_dtype_name(arch)
        return Capabilities(
            dtypes=GPU_DTYPES,
            kv_cache_dtypes=GPU_DTYPES,
            block_sizes=BLOCK_SIZES,
            head_sizes=HEAD_SIZES,
            quant_schemes=(FP8_SCHEME,) if fp8 else (),
            graph_capture=True,
            sliding_window=True,
            logits_soft_cap=True,
            swap=True,
            extra={"gcn_arch": arch, "wavefront_size": wavefront_size(arch), "fp8_dtype": fp8},
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
        """This GPU's launch parameters (built once), or the interpreter's."""
        if self._tuning is None:
            from engine_plugin_amd.tuning import tuning_for_device

            self._tuning = tuning_for_device(self.interpret)
        return self._tuning

    def make_attention_backend(self) -> AttentionBackend:
        from engine_plugin_amd.attention import RocmTritonAttentionBackend

        return RocmTritonAttentionBackend(self.kernel_tuning())

    def make_gemm_backend(self) -> GemmBackend:
        from engine_plugin_amd.gemm import RocmGemmBackend
        from engine_plugin_amd.tuning import fp8_dtype_name

        fp8 = None if self.interpret else fp8_dtype_name(self.arch())
        return RocmGemmBackend(self.torch_device(), fp8_dtype=fp8)

    def make_block_cache(self, spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend) -> BlockCache:
        from engine_plugin_amd.block_cache import make_rocm_block_cache

        return make_rocm_block_cache(spec, num_blocks, attention, self.torch_device())

    def make_graph_capture(self) -> GraphCapture:
        if self.interpret:
            return EagerGraphCapture()
        from engine_plugin_amd.graph_capture import HipGraphCapture

        return HipGraphCapture()

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        self.kernel_tuning()  # interpreter mode is set in __init__, before the kernels are imported here
        from engine_plugin_nvidia.triton_kernels import launchers

        return {
            "rms_norm": launchers.rms_norm,
            "fused_add_rms_norm": launchers.fused_add_rms_norm,
            "rotary_embedding": launchers.rotary_embedding,
            "silu_and_mul": launchers.silu_and_mul,
        }

    def make_communicator(self, world_size: int, rank: int, init_method: str) -> Any:
        """An RCCL communicator for tensor parallelism (see :mod:`engine_plugin_amd.communicator`)."""
        from engine_plugin_amd.communicator import RcclCommunicator

        return RcclCommunicator(world_size, rank, init_method)


def has_rocm_gpu() -> bool:
    """An AMD GPU is visible to a ROCm build of torch, asked without initialising the device.

    ``device_count`` on ROCm asks the HIP runtime for a count without creating a context and without
    torch's lazy CUDA init; a CUDA or CPU build (``torch.version.hip is None``) is never ours.
    """
    import torch

    if getattr(torch.version, "hip", None) is None:
        return False
    return torch.cuda.device_count() > 0

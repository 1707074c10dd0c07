"""The ROCm platform: detection without touching the GPU, honest capabilities, memory, factories.

A ROCm build of torch drives AMD GPUs through the ``torch.cuda`` API (HIP is exposed under that name),
so ``torch.cuda.is_available()`` is True there too: what tells ROCm from CUDA is ``torch.version.hip``.
Because of that same API, everything vendor-neutral (interpreter mode, memory, validation, the block
pool, factories) is the SDK's :class:`~engine_plugin_sdk.gpu.platform.TorchGpuPlatform`; this module adds
detection through ``torch.version.hip``, claims by ``gcnArchName``, and the typed factory hooks naming the
launch table of :mod:`engine_plugin_amd.tuning` and this plugin's backend classes. Each hook imports its
module in its body, so importing this module (and detecting the platform) loads no Triton.

``ENGINE_AMD_INTERPRET=1`` on a machine without an AMD GPU makes the platform available in
*interpreter mode*: the shared Triton kernels run on CPU tensors through Triton's interpreter with this
plugin's CDNA-shaped launch parameters. It claims float16 / float32 only (``tl.dot`` on bfloat16 is
wrong in the interpreter), no graphs and no FP8. Nothing here has run on AMD hardware yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_plugin_sdk.gpu.platform import TorchGpuPlatform

if TYPE_CHECKING:
    from engine_plugin_amd.attention import RocmTritonAttentionBackend
    from engine_plugin_amd.communicator import RcclCommunicator
    from engine_plugin_amd.gemm import RocmGemmBackend
    from engine_plugin_amd.graph_capture import HipGraphCapture
    from engine_plugin_sdk.gpu.triton_kernels.launch import KernelTuning

INTERPRET_ENV = "ENGINE_AMD_INTERPRET"


class RocmPlatform(TorchGpuPlatform):
    """One AMD GPU (HIP device 0, ``torch.device("cuda", 0)`` under ROCm) driven through torch and Triton."""

    name = "rocm"
    aliases = ("amd", "hip")
    # below cuda: on a (rare) host with both, a CUDA build of torch cannot drive the AMD GPU anyway
    priority = 90
    vendor = "AMD"
    interpret_env = INTERPRET_ENV
    triton_missing_reason = "the triton package is not installed (ROCm wheels ship it as pytorch-triton-rocm)"

    def __init__(self) -> None:
        super().__init__()
        self._arch: str | None = None

    @classmethod
    def gpu_visible(cls) -> bool:
        # looked up at call time, so that tests can simulate a host by patching the module function
        return has_rocm_gpu()

    @classmethod
    def unavailable_reason(cls) -> str:
        import torch

        if torch.version.hip is None:
            build = "a CUDA" if torch.version.cuda is not None else "a CPU-only"
            return f"this torch build ({torch.__version__}) is {build} build without ROCm/HIP (torch.version.hip is None)"
        return (
            f"no AMD GPU is visible to this ROCm build (HIP {torch.version.hip}): torch.cuda.device_count() is 0 "
            "(check HIP_VISIBLE_DEVICES and access to /dev/kfd)"
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

    def wavefront_size(self) -> int:
        """Lanes per wavefront of GPU 0: 64 on CDNA (``gfx9*``), 32 on RDNA."""
        from engine_plugin_amd.tuning import wavefront_size

        return wavefront_size(self.arch())

    def device_fp8_dtype(self) -> str | None:
        from engine_plugin_amd.tuning import fp8_dtype_name

        return fp8_dtype_name(self.arch())

    def device_extra(self) -> dict[str, Any]:
        # labels for `engine plugins list` and reports; code asks arch(), wavefront_size() and fp8_dtype()
        return {"gcn_arch": self.arch(), "wavefront_size": self.wavefront_size(), "fp8_dtype": self.device_fp8_dtype()}

    def interpreter_extra(self) -> dict[str, Any]:
        return {**super().interpreter_extra(), "launch_parameters": "cdna-interpreter"}

    # --- typed factories: each imports its module here, never at module import ---------------------

    def kernel_tuning_for_device(self, interpret: bool) -> KernelTuning:
        from engine_plugin_amd.tuning import tuning_for_device

        return tuning_for_device(interpret)

    def attention_backend_class(self) -> type[RocmTritonAttentionBackend]:
        from engine_plugin_amd.attention import RocmTritonAttentionBackend

        return RocmTritonAttentionBackend

    def gemm_backend_class(self) -> type[RocmGemmBackend]:
        from engine_plugin_amd.gemm import RocmGemmBackend

        return RocmGemmBackend

    def graph_capture_class(self) -> type[HipGraphCapture]:
        from engine_plugin_amd.graph_capture import HipGraphCapture

        return HipGraphCapture

    def communicator_class(self) -> type[RcclCommunicator]:
        from engine_plugin_amd.communicator import RcclCommunicator

        return RcclCommunicator


#: ``interpreter_requested(environ=None)``: whether ``ENGINE_AMD_INTERPRET=1`` is set
interpreter_requested = RocmPlatform.interpreter_requested


def has_rocm_gpu() -> bool:
    """An AMD GPU is visible to a ROCm build of torch, asked without initialising the device.

    ``device_count`` on ROCm asks the HIP runtime for a count without creating a context and without
    torch's lazy CUDA init; a CUDA or CPU build (``torch.version.hip is None``) is never ours.
    """
    import torch

    if getattr(torch.version, "hip", None) is None:
        return False
    return torch.cuda.device_count() > 0

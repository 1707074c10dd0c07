"""The platform logic every torch-driven GPU shares: interpreter mode, claims, memory, factories.

A vendor subclass of :class:`TorchGpuPlatform` supplies detection (:meth:`~TorchGpuPlatform.gpu_visible`,
:meth:`~TorchGpuPlatform.unavailable_reason`), what the device claims (:meth:`~TorchGpuPlatform.device_dtypes`,
:meth:`~TorchGpuPlatform.device_fp8_dtype`, ...) and five typed factory hooks naming its pieces:
:meth:`~TorchGpuPlatform.kernel_tuning_for_device`, :meth:`~TorchGpuPlatform.attention_backend_class`,
:meth:`~TorchGpuPlatform.gemm_backend_class`, :meth:`~TorchGpuPlatform.graph_capture_class` and
:meth:`~TorchGpuPlatform.communicator_class`. Each hook imports its module inside its body: those modules
import torch and Triton, and detecting the platform must not.

``<VENDOR>_INTERPRET=1`` on a machine without the vendor's GPU makes the platform available in
*interpreter mode*: the shared Triton kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set by the platform before the kernels are imported). It claims only float16 /
float32 (``tl.dot`` on bfloat16 is wrong in the interpreter) and no graphs or FP8; of the quantization
schemes, the grouped integer ones and the GGUF types repacked into them, whose Triton GEMM and GEMV run
there as on the GPU.

Importing this module must stay cheap: no torch, no Triton (both are imported inside methods).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine.interfaces.gemm import GemmBackend
from engine.interfaces.graph_capture import EagerGraphCapture, GraphCapture
from engine.interfaces.platform import Capabilities, DetectResult, Platform
from engine.interfaces.step_overlap import SerialStepOverlap, StepOverlap

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine_plugin_sdk.gpu.attention import TritonPagedAttentionBackend
    from engine_plugin_sdk.gpu.communicator import TorchDistCommunicator
    from engine_plugin_sdk.gpu.gemm import TorchGemmBackend
    from engine_plugin_sdk.gpu.graph_capture import TorchGraphCapture
    from engine_plugin_sdk.gpu.triton_kernels.launch import KernelTuning

GPU_DTYPES = ("bfloat16", "float16", "float32")
#: interpreter: float32 first, so ``--dtype auto`` picks the exact one
INTERPRETER_DTYPES = ("float32", "float16")
BLOCK_SIZES = (8, 16, 32, 64)
HEAD_SIZES = (64, 80, 96, 128, 256)
FP8_SCHEME = "fp8_e4m3"
#: weight-only schemes the shared Triton GEMM / GEMV run on every GPU: the grouped integer ones, and the GGUF
#: types repacked into them exactly at load (``engine_plugin_sdk.grouped_codes``; spelled out here:
#: importing either module would import torch); other GGUF types are dequantized at load
GROUPED_INT_SCHEMES = (
    "int4_grouped", "int8_grouped", "gguf_q4_0", "gguf_q4_1", "gguf_q8_0", "gguf_q4_k", "gguf_q6_k", "gguf_q5_0",
    "gguf_q5_1", "gguf_q5_k", "gguf_q3_k", "gguf_q2_k", "gguf_iq4_nl", "gguf_iq4_xs",
)  # fmt: skip
INTERPRETER_KV_CACHE_BYTES = 256 * 1024**2


def interpreter_requested(env_var: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``env_var`` is ``"1"`` in ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    return env.get(env_var, "").strip() == "1"


def cpu_only_torch_build() -> str | None:
    """The installed torch's version when its wheel is a CPU-only build, told without importing torch.

    Importing torch takes seconds; ``engine plugins list`` on a machine with a CPU build of torch should not
    pay them to learn that no GPU platform is available. The wheel's version tag (``2.13.0+cpu``) says it.

    Returns:
        The version, when torch is not imported yet and its version carries the ``+cpu`` tag; None
        otherwise: torch already imported (asking it is free), not installed, or a build whose tag does
        not settle it (PyPI's CUDA wheels carry none), so that torch must be asked.
    """
    if "torch" in sys.modules:
        return None
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    return version if version.partition("+")[2].startswith("cpu") else None


class TorchGpuPlatform(Platform):
    """One GPU (``cuda:0``, or the one :meth:`use_device` picks; HIP under ROCm) driven through torch and the
    shared Triton kernels.

    Class attributes a subclass sets, besides ``name`` / ``aliases`` / ``priority``:
        vendor: ``"NVIDIA"``, ``"AMD"``: used in messages.
        interpret_env: the environment variable that asks for interpreter mode.
        triton_missing_reason: what :meth:`detect` says without the triton package.

    A subclass also implements the abstract detection and factory hooks below.
    """

    torch_device_type = "cuda"
    ray_device_resource: str | None = "GPU"
    vendor: ClassVar[str] = "GPU"
    interpret_env: ClassVar[str] = ""
    triton_missing_reason: ClassVar[str] = "the triton package is not installed (pip install 'engine[gpu]')"

    def __init__(self) -> None:
        self.interpret = self.interpreter_requested() and not self.gpu_visible()
        if self.interpret:
            # Triton decides interpreted or compiled when a kernel is defined: set it before the kernels load
            os.environ["TRITON_INTERPRET"] = "1"
            self.torch_device_type = "cpu"
            self.ray_device_resource = None
        self._tuning: KernelTuning | None = None
        #: the GPU this process drives (a parallel rank's or a data-parallel replica's own)
        self.device_index = 0

    # --- vendor hooks: detection and claims ---------------------------------------------------------

    @classmethod
    @abstractmethod
    def gpu_visible(cls) -> bool:
        """Whether one of this vendor's GPUs is visible, asked without initialising the device."""

    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str:
        """Why :meth:`detect` says no when triton is installed but no GPU is visible (may import torch)."""

    def device_dtypes(self) -> tuple[str, ...]:
        """The model and KV-cache dtypes GPU 0 runs (not called in interpreter mode)."""
        return GPU_DTYPES

    def device_fp8_dtype(self) -> str | None:
        """The torch FP8 e4m3 dtype name GPU 0's matrix units take, or None (not called in interpreter mode)."""
        return None

    def device_fp8_kv_cache_dtypes(self) -> tuple[str, ...]:
        """FP8 KV cache dtypes GPU 0 runs, beyond :meth:`device_dtypes` (none unless a vendor checked them)."""
        return ()

    def device_extra(self) -> dict[str, Any]:
        """Informational ``Capabilities.extra`` labels on a real GPU (what identifies the part); no code
        reads them as a contract: the typed methods are the contract."""
        return {}

    def interpreter_extra(self) -> dict[str, Any]:
        """Informational ``Capabilities.extra`` labels in interpreter mode."""
        return {"mode": "triton-interpreter"}

    # --- vendor hooks: typed factories (each imports its module in its body) ------------------------

    @abstractmethod
    def kernel_tuning_for_device(self, interpret: bool) -> KernelTuning:
        """The launch parameters of GPU 0, or the interpreter's when ``interpret`` (built once per platform).

        Args:
            interpret: the kernels run in Triton's CPU interpreter.

        Returns:
            The :class:`~engine_plugin_sdk.gpu.triton_kernels.launch.KernelTuning` every launcher takes.
        """

    @abstractmethod
    def attention_backend_class(self) -> type[TritonPagedAttentionBackend]:
        """The paged-attention backend class, built with :meth:`kernel_tuning`."""

    @abstractmethod
    def gemm_backend_class(self) -> type[TorchGemmBackend]:
        """The GEMM backend class, built with ``(device, fp8_dtype=...)``."""

    @abstractmethod
    def graph_capture_class(self) -> type[TorchGraphCapture]:
        """The graph capture class (used on a real GPU only; the interpreter runs eagerly)."""

    @abstractmethod
    def communicator_class(self) -> type[TorchDistCommunicator]:
        """The communicator class, built with ``(world_size, rank, init_method, local_rank)``."""

    def step_overlap_attention_sms(self) -> int:
        """SMs (compute units) the matrix products leave to the attention lane in an overlapped step
        (:class:`~engine_plugin_sdk.gpu.step_overlap.TorchStreamStepOverlap`); 0, the default, leaves the
        products whole."""
        return 0

    def step_overlap_attention_priority(self) -> int:
        """The attention lane's stream priority in an overlapped step (0, the default: the same as the
        step's stream; negative: higher)."""
        return 0

    # --- detection and claims -----------------------------------------------------------------------

    @classmethod
    def interpreter_requested(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the user asked for interpreter mode (:attr:`interpret_env` is ``1``)."""
        return interpreter_requested(cls.interpret_env, environ)

    @classmethod
    def detect(cls) -> DetectResult:
        if importlib.util.find_spec("triton") is None:
            return DetectResult(False, cls.triton_missing_reason)
        cpu_build = cpu_only_torch_build()
        if cpu_build is None and cls.gpu_visible():
            return DetectResult(True)
        if cls.interpreter_requested():
            return DetectResult(True, f"no {cls.vendor} GPU: Triton interpreter on the CPU ({cls.interpret_env}=1)")
        if cpu_build is not None:
            return DetectResult(False, f"this torch build ({cpu_build}) is CPU-only: it cannot drive {cls.vendor} GPUs")
        return DetectResult(False, cls.unavailable_reason())

    def fp8_dtype(self) -> str | None:
        """The FP8 dtype weights are kept in, or None (always None in interpreter mode)."""
        return None if self.interpret else self.device_fp8_dtype()

    def capabilities(self) -> Capabilities:
        if self.interpret:
            return Capabilities(
                dtypes=INTERPRETER_DTYPES,
                kv_cache_dtypes=INTERPRETER_DTYPES,
                block_sizes=BLOCK_SIZES,
                head_sizes=HEAD_SIZES,
                sliding_window=True,
                logits_soft_cap=True,
                attention_sinks=True,
                non_causal_attention=True,
                non_causal_sliding_window=True,
                swap=True,
                quant_schemes=GROUPED_INT_SCHEMES,
                # the LoRA kernels run in the interpreter as on the GPU (float16 / float32 only, like tl.dot)
                lora=True,
                # no graphs, but the backend's recorded-step path runs as on the GPU (conformance checks it)
                graph_capture_verify=True,
                graph_capture_prefill=True,
                # no streams: the lanes are the one queue (SerialStepOverlap), the nano-batches run as on the GPU
                step_overlap=True,
                extra=self.interpreter_extra(),
            )
        dtypes = self.device_dtypes()
        return Capabilities(
            dtypes=dtypes,
            kv_cache_dtypes=dtypes + self.device_fp8_kv_cache_dtypes(),
            block_sizes=BLOCK_SIZES,
            head_sizes=HEAD_SIZES,
            quant_schemes=((FP8_SCHEME,) if self.fp8_dtype() else ()) + GROUPED_INT_SCHEMES,
            graph_capture=True,
            sliding_window=True,
            logits_soft_cap=True,
            attention_sinks=True,
            non_causal_attention=True,
            non_causal_sliding_window=True,
            swap=True,
            # Triton compiles each kernel variant on its first launch
            warm_up=True,
            # NCCL (RCCL) needs the GPUs: the interpreter does not claim it
            distributed=True,
            # the shared Triton LoRA kernels: no host read of the slots, so inside decode graphs too
            lora=True,
            extra=self.device_extra(),
            # NCCL (>= 2.9.6; RCCL alike) records into a graph being captured: torch's process group launches
            # each collective on its own stream fenced by events on the capturing one (no host sync), and
            # the communicator's all_reduce (in place) and all_gather (empty_like parts, a cat) allocate
            # only through the caching allocator, i.e. from the graphs' pool. The lazy creation of each
            # NCCL communicator, which may not happen while capturing, falls in the eager warm-up runs
            # TorchGraphCapture makes before recording each bucket.
            graph_capture_collectives=True,
            # the Triton backend runs a recorded step's rows from its device tensors alone (short rows as
            # decode rows, longer ones through the prefill kernel's device offsets)
            graph_capture_verify=True,
            # a lone prompt chunk the same way: the prefill kernel's grid follows the bucket, its rows and
            # context come from the device offsets
            graph_capture_prefill=True,
            # a second stream for the attention lane (engine_plugin_sdk.gpu.step_overlap), forked and joined
            # by events, which a graph being recorded takes as branches
            step_overlap=True,
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

    # --- memory -------------------------------------------------------------------------------------

    def total_memory_bytes(self) -> int:
        if self.interpret:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        import torch

        return int(torch.cuda.get_device_properties(self.device_index).total_memory)

    def free_memory_bytes(self) -> int:
        if self.interpret:
            return min(self.total_memory_bytes(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
        import torch

        free, _ = torch.cuda.mem_get_info(self.device_index)
        return int(free)

    def default_kv_cache_bytes(self) -> int | None:
        return INTERPRETER_KV_CACHE_BYTES if self.interpret else None

    def synchronize(self) -> None:
        if not self.interpret:
            import torch

            torch.cuda.synchronize()

    def torch_device(self) -> Any:
        import torch

        return torch.device("cpu") if self.interpret else torch.device("cuda", self.device_index)

    def use_device(self, local_rank: int) -> None:
        """Drive ``cuda:local_rank`` (made the current device too: NCCL and the caching allocator follow
        it); in the interpreter every rank runs on the host CPU.

        Raises:
            RuntimeError: this host has no GPU ``local_rank``.
        """
        if self.interpret:
            return
        import torch

        count = torch.cuda.device_count()
        if not 0 <= local_rank < count:
            raise RuntimeError(f"{self.name}: there is no GPU {local_rank} here ({count} visible)")
        torch.cuda.set_device(local_rank)
        self.device_index = local_rank

    # --- factories ----------------------------------------------------------------------------------

    def kernel_tuning(self) -> KernelTuning:
        """This GPU's launch parameters (built once), or the interpreter's."""
        if self._tuning is None:
            self._tuning = self.kernel_tuning_for_device(self.interpret)
            if self._tuning.use_pdl:
                from engine_plugin_sdk.gpu.triton_kernels import pdl

                pdl.configure(True)
        return self._tuning

    def make_attention_backend(self) -> AttentionBackend:
        return self.attention_backend_class()(self.kernel_tuning())

    def make_gemm_backend(self) -> GemmBackend:
        backend = self.gemm_backend_class()(self.torch_device(), fp8_dtype=self.fp8_dtype())
        if self.interpret:
            self.kernel_tuning()  # sets interpreter mode before the MoE kernels are imported
            from engine_plugin_sdk.gpu.triton_kernels import grouped_int_tiles, lora_launchers
            from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import INTERPRETER_MOE_TILES

            backend.triton_moe, backend.moe_tiles = True, INTERPRETER_MOE_TILES
            backend.triton_grouped_int = True
            backend.grouped_int_tiles = grouped_int_tiles.INTERPRETER_GROUPED_INT_TILES
            backend.triton_lora, backend.lora_tiles = True, lora_launchers.INTERPRETER_LORA_TILES
            backend.triton_gated = True
            backend.triton_router_norm = True
        return backend

    def make_graph_capture(self) -> GraphCapture:
        if self.interpret:
            return EagerGraphCapture()
        return self.graph_capture_class()()

    def make_step_overlap(self) -> StepOverlap:
        if self.interpret:
            return SerialStepOverlap()
        from engine_plugin_sdk.gpu.step_overlap import TorchStreamStepOverlap

        return TorchStreamStepOverlap(
            self.device_index, self.step_overlap_attention_sms(), self.step_overlap_attention_priority()
        )

    def make_block_cache(self, spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend) -> BlockCache:
        from engine_plugin_sdk.torch_block_cache import TorchBlockCache

        # page-locked host blocks make swaps asynchronous copies; the interpreter's pool is host memory already
        return TorchBlockCache(spec, num_blocks, attention, self.torch_device(), pin_host=not self.interpret)

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        self.kernel_tuning()  # interpreter mode is set in __init__, before the kernels are imported here
        from engine_plugin_sdk.gpu.triton_kernels import launchers
        from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import moe_topk
        from engine_plugin_sdk.gpu.triton_kernels.post_norm import post_norm_add_rms_norm
        from engine_plugin_sdk.gpu.triton_kernels.token_bitmask import apply_token_bitmask

        return {
            "rms_norm": launchers.rms_norm,
            "fused_add_rms_norm": launchers.fused_add_rms_norm,
            "rotary_embedding": launchers.rotary_embedding,
            "silu_and_mul": launchers.silu_and_mul,
            "gelu_tanh_and_mul": launchers.gelu_tanh_and_mul,
            "layer_norm": launchers.layer_norm,
            "add_layer_norm": launchers.add_layer_norm,
            "greedy_pick": launchers.greedy_pick,
            "apply_token_bitmask": apply_token_bitmask,
            "post_norm_add_rms_norm": post_norm_add_rms_norm,
            "moe_topk": moe_topk,
        }

    def make_communicator(
        self, world_size: int, rank: int, init_method: str, local_rank: int = 0
    ) -> TorchDistCommunicator:
        """This process's communicator, one process per GPU (:meth:`communicator_class`).

        Args:
            world_size: processes (one GPU each).
            rank: this process's rank.
            init_method: rendezvous address, e.g. ``"tcp://127.0.0.1:29500"``.
            local_rank: the GPU this process drives.

        Raises:
            NotImplementedError: in interpreter mode, which has no GPU for the collective library.
            RuntimeError: when the torch build or the GPUs cannot run the vendor's collective library.
        """
        if self.interpret:
            raise NotImplementedError(
                f"platform {self.name!r} in interpreter mode has no communicator "
                "(it does not claim 'distributed')"
            )
        return self.communicator_class()(world_size, rank, init_method, local_rank)

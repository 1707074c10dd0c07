"""The Ascend NPU platform: detection, capability claims, validation, memory, and the backend factories.

The kernel module behind every backend is chosen once per platform instance by
:func:`engine_plugin_ascend.kernel_switch.selected_kernels`. With the testing switch
``ENGINE_ASCEND_KERNELS=reference`` the platform reports itself available, runs on CPU tensors, and
says so in ``capabilities().extra["kernels"]``, so a conformance report made that way cannot be
mistaken for one made on an NPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from engine_plugin_ascend import kernel_switch, runtime
from engine_plugin_ascend.layout import (
    PREFERRED_DTYPE,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_SIZES,
)
from engine_plugin_sdk import (
    AttentionBackend,
    BlockCache,
    Capabilities,
    DetectResult,
    GemmBackend,
    GraphCapture,
    KVCacheSpec,
    Platform,
)

if TYPE_CHECKING:
    from engine_plugin_ascend.communicator import AscendCommunicator
    from engine_plugin_sdk import EngineConfig

#: the KV budget on the reference substitute, which shares host RAM with everything else
REFERENCE_KV_CACHE_BYTES = 1024**3
REFERENCE_LABEL = (
    "reference: CPU substitute for torch_npu kernels (testing only; the NPU kernels are not run)"
)


class AscendPlatform(Platform):
    """Huawei Ascend NPUs through torch_npu."""

    name = "npu"
    aliases = ("ascend",)
    # above the CPU (0): an NPU host running --device auto should use its NPU
    priority = 50
    torch_device_type = "npu"
    ray_device_resource: str | None = "NPU"

    def __init__(self) -> None:
        # read once: the kernel module must not change under a running engine
        self.kernel_impl = kernel_switch.selected_kernels(os.environ)
        self._kernels: ModuleType | None = None

    @classmethod
    def detect(cls) -> DetectResult:
        try:
            impl = kernel_switch.selected_kernels(os.environ)
        except ValueError as exc:
            return DetectResult(False, str(exc))
        if impl == kernel_switch.REFERENCE_KERNELS:
            return DetectResult(True)
        return runtime.detect_npu()

    @property
    def kernels(self) -> ModuleType:
        """The kernel module (imported on first use; importing it does not import torch_npu)."""
        if self._kernels is None:
            self._kernels = kernel_switch.load_kernels(self.kernel_impl)
        return self._kernels

    @property
    def uses_reference_kernels(self) -> bool:
        return self.kernel_impl == kernel_switch.REFERENCE_KERNELS

    def capabilities(self) -> Capabilities:
        kernels = REFERENCE_LABEL if self.uses_reference_kernels else "torch_npu"
        return Capabilities(
            dtypes=SUPPORTED_DTYPES,
            kv_cache_dtypes=SUPPORTED_DTYPES,
            block_sizes=SUPPORTED_BLOCK_SIZES,
            head_sizes=SUPPORTED_HEAD_SIZES,
            quant_schemes=(),
            # AscendGraphCapture records NPU graphs, but a captured decode step would bake the fused
            # attention's host-side sequence lengths into the graph; until they are refreshed through
            # torch_npu's graph-update mechanism, the engine must not replay decode steps here
            graph_capture=False,
            sliding_window=False,
            logits_soft_cap=False,
            swap=True,
            distributed=True,
            # the GemmBackend default: index_select, bmm and index_add_, which torch_npu runs; graphs are
            # not claimed, so the default's host-side plan is never recorded
            lora=True,
            extra={"preferred_dtype": PREFERRED_DTYPE, "kernels": kernels},
        )

    def validate(self, config: EngineConfig) -> list[str]:
        if config.dtype == "auto":
            config = config.model_copy(update={"dtype": PREFERRED_DTYPE})
        reasons = super().validate(config)
        kv = config.cache.kv_cache_dtype
        if (
            kv is not None
            and kv != config.dtype
            and kv in SUPPORTED_DTYPES
            and config.dtype in SUPPORTED_DTYPES
        ):
            reasons.append(f"KV cache dtype {kv!r} must equal the model dtype {config.dtype!r} on npu")
        return reasons

    def torch_device(self) -> Any:
        return self.kernels.torch_device()

    def total_memory_bytes(self) -> int:
        return self.kernels.mem_get_info()[1]

    def free_memory_bytes(self) -> int:
        free, total = self.kernels.mem_get_info()
        return min(free, total)

    def default_kv_cache_bytes(self) -> int | None:
        if self.uses_reference_kernels:
            return min(REFERENCE_KV_CACHE_BYTES, self.free_memory_bytes() // 4)
        return None

    def synchronize(self) -> None:
        self.kernels.synchronize()

    def seed(self, seed: int) -> None:
        self.kernels.manual_seed(seed)

    def make_attention_backend(self) -> AttentionBackend:
        from engine_plugin_ascend.attention import AscendAttentionBackend

        return AscendAttentionBackend(self.kernels)

    def make_gemm_backend(self) -> GemmBackend:
        from engine_plugin_ascend.gemm import AscendGemmBackend

        return AscendGemmBackend(self.torch_device())

    def make_block_cache(self, spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend) -> BlockCache:
        from engine_plugin_sdk import TorchBlockCache

        # page-locked host pool: swaps then copy by DMA without a staging buffer (ignored on the CPU substitute)
        return TorchBlockCache(spec, num_blocks, attention, device=self.torch_device(), pin_host=True)

    def make_graph_capture(self) -> GraphCapture:
        from engine_plugin_ascend.graph import AscendGraphCapture

        return AscendGraphCapture(self.kernels)

    def make_communicator(
        self, world_size: int, rank: int, init_method: str, local_rank: int = 0
    ) -> AscendCommunicator:
        """This process's communicator over HCCL (gloo on the reference kernels' CPU substitute).

        Args:
            world_size: ranks in the group.
            rank: this process's rank.
            init_method: the rendezvous every rank passes, e.g. ``"tcp://127.0.0.1:29500"``.
            local_rank: the NPU this process drives.

        Raises:
            ValueError: for a rank outside ``[0, world_size)``.
            RuntimeError: torch_npu cannot be imported, or the process group cannot be formed.
        """
        from engine_plugin_ascend.communicator import AscendCommunicator

        return AscendCommunicator(world_size, rank, init_method, local_rank, kernels=self.kernels)

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        from engine_plugin_ascend.ops import AscendOps

        return AscendOps(self.kernels).overrides()

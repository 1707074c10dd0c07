"""The CPU platform: always available, lowest priority, memory from /proc/meminfo."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from engine_plugin_sdk import (
    AttentionBackend,
    BlockCache,
    Capabilities,
    Communicator,
    DetectResult,
    EagerGraphCapture,
    GemmBackend,
    GraphCapture,
    KVCacheSpec,
    Platform,
)

if TYPE_CHECKING:
    from engine_plugin_cpu.native_kernels import NativeKernels
    from engine_plugin_sdk import EngineConfig

logger = logging.getLogger(__name__)

MEMINFO_PATH = "/proc/meminfo"
CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"
CGROUP_MEMORY_CURRENT = "/sys/fs/cgroup/memory.current"

SUPPORTED_DTYPES = ("float32", "bfloat16")
#: GGUF schemes the GEMM keeps quantized (packed int4 / int8 kernels, in bfloat16)
QUANT_SCHEMES = ("gguf_q4_0", "gguf_q4_1", "gguf_q8_0", "gguf_q5_0", "gguf_iq4_nl", "gguf_iq4_xs")
#: grouped-int weights (GPTQ / AWQ / compressed-tensors): on the packed kernels where they repack exactly
#: into the GGUF types above (engine_plugin_cpu.grouped_int), else dequantized at load
GROUPED_QUANT_SCHEMES = ("int4_grouped", "int8_grouped")
#: GGUF K-quants (Q3_K in Q6_K's records, Q2_K in them with mins; and Q5_1, whose d and m per 32 weights are
#: Q5_K's records), kept quantized where the plugin's C kernels run (else dequantized at load)
NATIVE_QUANT_SCHEMES = ("gguf_q4_k", "gguf_q5_k", "gguf_q6_k", "gguf_q5_1", "gguf_q3_k", "gguf_q2_k")
#: /proc/cpuinfo flags of a native bf16 dot product (AVX-512 BF16, AMX)
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
CPUINFO_PATH = "/proc/cpuinfo"
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64)
#: the KV budget when the user sets none: host RAM is shared with everything else on the machine
DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
#: the KV budget in GiB when the user sets none (vLLM's ``VLLM_CPU_KVCACHE_SPACE``); ``--kv-cache-memory`` wins
KVCACHE_SPACE_ENV = "ENGINE_CPU_KVCACHE_SPACE"
# torch's CPU SDPA and the fallback matmul path have no head-size limits; these are the tested ones
#: 576: DeepSeek's latent rows (kv_lora_rank 512 + rotary key 64), attended as one KV head
SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 256, 576)
#: set to 1 to compile decode steps with torch.compile (graph_capture claimed); off by default because
#: on 2 cores it bought ~12% at batch 1, nothing at 32, for 2+ minutes of start-up (BENCHMARKS.md)
COMPILE_ENV = "ENGINE_CPU_COMPILE"
#: an encoder's step budget: small enough that a step's activations stay in cache between its products
#: (bge-small, 128-token texts, 2-core Xeon, bf16: 24-32 texts a step ran about 1.1x faster than 64, and
#: 1.15x faster than the core's 256)
ENCODER_STEP_TOKENS = 4096


def kv_cache_space_bytes(space: str) -> int:
    """``ENGINE_CPU_KVCACHE_SPACE``'s GiB (a positive number, fractions allowed) in bytes.

    Raises:
        ValueError: for anything else, naming the variable.
    """
    try:
        gib = float(space)
    except ValueError:
        gib = float("nan")
    if not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"{KVCACHE_SPACE_ENV} must be a positive number of GiB, got {space!r}")
    return int(gib * 1024**3)


class CpuPlatform(Platform):
    """Runs everything on the host CPU with torch."""

    name = "cpu"
    aliases = ("host",)
    priority = 0
    torch_device_type = "cpu"

    def __init__(self) -> None:
        self._native: NativeKernels | None = None
        self._native_checked = False

    @classmethod
    def detect(cls) -> DetectResult:
        # a process that runs Python has a CPU; nothing to initialise
        return DetectResult(True)

    def capabilities(self) -> Capabilities:
        preferred = preferred_dtype()
        # the core resolves ``--dtype auto`` to the first listed dtype
        dtypes = (preferred, *(d for d in SUPPORTED_DTYPES if d != preferred))
        return Capabilities(
            dtypes=dtypes,
            kv_cache_dtypes=SUPPORTED_DTYPES,
            block_sizes=SUPPORTED_BLOCK_SIZES,
            head_sizes=SUPPORTED_HEAD_SIZES,
            quant_schemes=QUANT_SCHEMES
            + GROUPED_QUANT_SCHEMES
            + (NATIVE_QUANT_SCHEMES if self.native_kernels_possible() else ()),
            graph_capture=compile_enabled(),
            sliding_window=True,
            logits_soft_cap=True,
            attention_sinks=True,
            non_causal_attention=True,
            non_causal_sliding_window=True,
            swap=True,
            distributed=True,
            # the GemmBackend default (rows grouped by slot, two batched products) runs as it is on the host,
            # but its plan reads the slots there, which a fullgraph torch.compile of a decode step cannot
            # record: no LoRA with compiled decode steps until the plan is built on the device
            lora=not compile_enabled(),
            extra={"preferred_dtype": preferred},
            # a compiled step holds tensor parallelism's all-reduces: torch.compile traces the gloo
            # communicator's dist.all_reduce into the graph as a functional collective, which runs on every
            # rank as the eager one does (each rank compiles the same buckets in the same order)
            graph_capture_collectives=compile_enabled(),
        )

    def validate(self, config: EngineConfig) -> list[str]:
        if config.dtype == "auto":
            # "auto" means "the platform's choice"; judge the dtype we would actually pick
            config = config.model_copy(update={"dtype": preferred_dtype()})
        return super().validate(config)

    def total_memory_bytes(self) -> int:
        total = read_meminfo_bytes("MemTotal")
        if total is None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        limit = read_cgroup_limit()
        return min(total, limit) if limit is not None else total

    def free_memory_bytes(self) -> int:
        free = read_meminfo_bytes("MemAvailable")
        if free is None:
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        limit = read_cgroup_limit()
        if limit is not None:
            used = read_int_file(CGROUP_MEMORY_CURRENT) or 0
            free = min(free, max(0, limit - used))
        return free

    def default_kv_cache_bytes(self) -> int | None:
        space = os.environ.get(KVCACHE_SPACE_ENV, "").strip()
        if space:
            return kv_cache_space_bytes(space)
        # a fixed size, but never more than a quarter of what is free: the swap pool and the model's
        # own weights and activations live in the same RAM
        return min(DEFAULT_KV_CACHE_BYTES, self.free_memory_bytes() // 4)

    def default_encoder_step_tokens(self) -> int | None:
        return ENCODER_STEP_TOKENS

    def native_kernels_possible(self) -> bool:
        """Whether the C kernels can be built here (CPU flags, a compiler, not turned off), without building."""
        if compile_enabled():
            return False
        from engine_plugin_cpu.native_build import native_prerequisites

        return not native_prerequisites()

    def native_kernels(self) -> NativeKernels | None:
        """The plugin's C kernels (built on first use, shared by the backends), or None where they cannot run.

        They are off for compiled steps (``torch.compile`` cannot trace a ctypes call) and wherever
        :func:`~engine_plugin_cpu.native_build.load_native` gives a reason, which is logged once.
        """
        if not self._native_checked:
            self._native_checked = True
            if compile_enabled():
                return None
            from engine_plugin_cpu.native_build import amx_usable, load_native
            from engine_plugin_cpu.native_kernels import NativeKernels

            loaded = load_native()
            if loaded.lib is None:
                logger.info("CPU C kernels not used (%s); running torch's kernels", loaded.reason)
            else:
                self._native = NativeKernels(loaded.lib, amx=amx_usable())
        return self._native

    def make_attention_backend(self) -> AttentionBackend:
        from engine_plugin_cpu.attention import CpuAttentionBackend

        return CpuAttentionBackend(native=self.native_kernels())

    def make_gemm_backend(self) -> GemmBackend:
        from engine_plugin_cpu.gemm import CpuGemmBackend

        return CpuGemmBackend(prepack=not compile_enabled(), native=self.native_kernels())

    def make_graph_capture(self) -> GraphCapture:
        if not compile_enabled():
            return EagerGraphCapture()
        from engine_plugin_cpu.graph_capture import CompiledGraphCapture

        return CompiledGraphCapture()

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        from engine_plugin_cpu.fast_ops import cpu_op_overrides

        return cpu_op_overrides(self.native_kernels())

    def use_device(self, local_rank: int) -> None:
        """Every rank and replica drives the host CPU (they share its cores); each process that does tunes
        its heap for the steps' large activations (:mod:`engine_plugin_cpu.heap`)."""
        from engine_plugin_cpu.heap import tune_process_heap

        tune_process_heap()

    def make_communicator(
        self, world_size: int, rank: int, init_method: str, local_rank: int = 0
    ) -> Communicator:
        """This process's communicator over gloo (``torch.distributed``'s CPU backend).

        Args:
            world_size: ranks in the group (processes, on this host or others).
            rank: this process's rank.
            init_method: the rendezvous every rank passes, e.g. ``"tcp://127.0.0.1:29500"``.
            local_rank: unused: every rank drives the host CPU.

        Raises:
            ValueError: for a rank outside ``[0, world_size)``.
            RuntimeError: the group cannot be formed.
        """
        from engine_plugin_sdk import TorchDistributedCommunicator

        return TorchDistributedCommunicator(world_size, rank, init_method, local_rank)

    def make_block_cache(self, spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend) -> BlockCache:
        from engine_plugin_sdk import TorchBlockCache

        # host RAM is the device here: the swap pool is just a second, smaller pool in the same memory
        return TorchBlockCache(spec, num_blocks, attention, device="cpu")


def compile_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether decode steps are compiled (``ENGINE_CPU_COMPILE=1``); ``enforce_eager`` still wins."""
    value = (os.environ if environ is None else environ).get(COMPILE_ENV, "0")
    return value.strip().lower() in ("1", "true", "yes", "on")


def preferred_dtype(cpuinfo_path: str = CPUINFO_PATH) -> str:
    """What ``--dtype auto`` means here: bfloat16 on a CPU with a native bf16 dot product, else float32.

    bf16 halves the bytes read per decoded token and runs the GEMMs at about twice the fp32 rate there;
    without native support torch emulates it and float32 is faster.
    """
    return "bfloat16" if cpu_flags(cpuinfo_path) & BF16_CPU_FLAGS else "float32"


def cpu_flags(path: str = CPUINFO_PATH) -> frozenset[str]:
    """The first processor's feature flags from ``/proc/cpuinfo``; empty where the file is absent."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(rest.split())
    except OSError:
        return frozenset()
    return frozenset()


def read_meminfo_bytes(field: str, path: str = MEMINFO_PATH) -> int | None:
    """A ``/proc/meminfo`` field in bytes, or None if the file or field is missing."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key == field:
                    parts = rest.split()
                    scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
                    return int(parts[0]) * scale
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_int_file(path: str) -> int | None:
    """An integer from a one-value file (cgroup style), or None if absent or not a number."""
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def read_cgroup_limit() -> int | None:
    """The cgroup v2 memory limit in bytes, or None when there is none ("max") or no cgroup v2."""
    return read_int_file(CGROUP_MEMORY_MAX)


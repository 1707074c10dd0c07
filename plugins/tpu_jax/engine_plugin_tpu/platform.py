"""The ``tpu`` platform: detection without touching the TPU, capabilities, memory, and the factories.

Detection never imports JAX: it looks for the TPU runtime package (``libtpu``) and a TPU device node.
Without a TPU the platform is unavailable and says why, unless ``ENGINE_TPU_ALLOW_CPU=1`` is set: then
it runs on JAX's CPU backend, labelled as such everywhere (detect reason, capabilities, logs). That is
how CI tests the plugin; it is not a way to run models fast.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any

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
    from engine_plugin_sdk import EngineConfig, PlatformModelRunner
    from engine_plugin_sdk.models import ModelConfig

logger = logging.getLogger(__name__)

#: set to 1 to run the plugin on JAX's CPU backend (testing only)
ALLOW_CPU_ENV = "ENGINE_TPU_ALLOW_CPU"
#: tensor-parallel size (devices on the "tp" mesh axis); default 1
TENSOR_PARALLEL_ENV = "ENGINE_TPU_TENSOR_PARALLEL"
#: "jnp" or "pallas"; default pallas on a TPU, jnp on the CPU backend
ATTENTION_ENV = "ENGINE_TPU_ATTENTION"
CPU_LABEL = "TPU NOT PRESENT: running on JAX's CPU backend for testing (ENGINE_TPU_ALLOW_CPU=1)"
#: device nodes a TPU VM exposes (v4 and later: /dev/accel*; v2/v3 and some v5e hosts: vfio)
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")
DEFAULT_CPU_KV_CACHE_BYTES = 1024**3
SUPPORTED_DTYPES = ("float32", "bfloat16")


def cpu_fallback_allowed(environ: Any = None) -> bool:
    """Whether the user explicitly allowed running on JAX's CPU backend."""
    value = (environ if environ is not None else os.environ).get(ALLOW_CPU_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def tpu_present() -> tuple[bool, str]:
    """Whether this host looks like a TPU host, judged without importing JAX or opening a device."""
    if importlib.util.find_spec("jax") is None:
        return False, "JAX is not installed (pip install 'jax[tpu]')"
    if importlib.util.find_spec("libtpu") is None:
        return False, "the TPU runtime libtpu is not installed (pip install 'jax[tpu]' on a TPU VM)"
    if not any(glob.glob(pattern) for pattern in TPU_DEVICE_GLOBS):
        return False, "no TPU device node (/dev/accel* or /dev/vfio) on this host"
    return True, ""


class TpuPlatform(Platform):
    """Google TPUs through JAX (or JAX's CPU backend when explicitly allowed, for testing)."""

    name = "tpu"
    aliases = ("jax",)
    priority = 20
    torch_device_type = "cpu"  # logits and host-side tensors; the model's arrays live in JAX

    def __init__(self) -> None:
        present, _ = tpu_present()
        self.on_tpu = present
        self.enforce_eager = False
        if not present and cpu_fallback_allowed():
            logger.warning(CPU_LABEL)

    @classmethod
    def detect(cls) -> DetectResult:
        present, why = tpu_present()
        if present:
            return DetectResult(True)
        if cpu_fallback_allowed() and importlib.util.find_spec("jax") is not None:
            return DetectResult(True, CPU_LABEL)
        return DetectResult(False, f"{why}; set {ALLOW_CPU_ENV}=1 to run this plugin on JAX's CPU backend for testing")

    # --- JAX, imported lazily ----------------------------------------------------------------------

    def _jax(self) -> Any:
        """Import JAX, pinning it to the CPU backend off-TPU (so it never probes for accelerators)."""
        import jax

        if not self.on_tpu:
            # only effective before JAX picks its backends; afterwards JAX keeps what it has
            jax.config.update("jax_platforms", "cpu")
        return jax

    def tensor_parallel_size(self) -> int:
        """From ``ENGINE_TPU_TENSOR_PARALLEL`` (default 1).

        Raises:
            ValueError: if it is not a positive integer.
        """
        raw = os.environ.get(TENSOR_PARALLEL_ENV, "1").strip()
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{TENSOR_PARALLEL_ENV} must be a positive integer, got {raw!r}")
        return int(raw)

    def attention_impl(self) -> str:
        """``ENGINE_TPU_ATTENTION`` or the default: Pallas on a TPU, jax.numpy elsewhere.

        Raises:
            ValueError: for an unknown value.
        """
        from engine_plugin_tpu.attention import ATTENTION_IMPLS

        impl = os.environ.get(ATTENTION_ENV, "pallas" if self.on_tpu else "jnp").strip()
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"{ATTENTION_ENV} must be one of {list(ATTENTION_IMPLS)}, got {impl!r}")
        return impl

    # --- claims --------------------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        from engine_plugin_tpu.attention import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_SIZES

        return Capabilities(
            dtypes=SUPPORTED_DTYPES,
            kv_cache_dtypes=SUPPORTED_DTYPES,
            block_sizes=SUPPORTED_BLOCK_SIZES,
            head_sizes=SUPPORTED_HEAD_SIZES,
            quant_schemes=(),
            # the generic GraphCapture is asked to capture torch functions, which JAX cannot trace; this
            # platform's capture is the jitted, bucketed whole-model step of its own runner
            graph_capture=False,
            sliding_window=True,
            logits_soft_cap=True,
            non_causal_attention=True,
            swap=True,
            extra={
                "backend": "tpu" if self.on_tpu else CPU_LABEL,
                "model_runner": "jax.jit whole forward, power-of-two shape buckets, donated KV pool",
                "preferred_dtype": "bfloat16" if self.on_tpu else "float32",
            },
        )

    def validate(self, config: EngineConfig) -> list[str]:
        if config.dtype == "auto":
            config = config.model_copy(update={"dtype": self.capabilities().extra["preferred_dtype"]})
        reasons = super().validate(config)
        try:
            self.tensor_parallel_size()
            self.attention_impl()
        except ValueError as exc:
            reasons.append(str(exc))
        return reasons

    # --- memory --------------------------------------------------------------------------------------

    def total_memory_bytes(self) -> int:
        if self.on_tpu:
            stats = self._jax().devices()[0].memory_stats() or {}
            if "bytes_limit" in stats:
                return int(stats["bytes_limit"])
        return _meminfo("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def free_memory_bytes(self) -> int:
        if self.on_tpu:
            stats = self._jax().devices()[0].memory_stats() or {}
            if "bytes_limit" in stats:
                return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        free = _meminfo("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return min(free, self.total_memory_bytes())

    def default_kv_cache_bytes(self) -> int | None:
        if self.on_tpu:
            return None
        return min(DEFAULT_CPU_KV_CACHE_BYTES, self.free_memory_bytes() // 4)

    def synchronize(self) -> None:
        jax = self._jax()
        jax.effects_barrier()

    # --- factories -----------------------------------------------------------------------------------

    def make_attention_backend(self) -> AttentionBackend:
        self._jax()
        from engine_plugin_tpu.attention import JaxAttentionBackend

        return JaxAttentionBackend(
            head_dim_multiple=128 if self.on_tpu else 1, impl=self.attention_impl(), interpret=not self.on_tpu
        )

    def make_gemm_backend(self) -> GemmBackend:
        self._jax()
        from engine_plugin_tpu.gemm import JaxGemmBackend

        return JaxGemmBackend()

    def make_block_cache(self, spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend) -> BlockCache:
        self._jax()
        from engine_plugin_tpu.block_cache import JaxBlockCache

        sharding = None
        tp = self.tensor_parallel_size()
        if tp > 1:
            from jax.sharding import NamedSharding

            from engine_plugin_tpu.sharding import make_mesh, pool_spec

            sharding = NamedSharding(make_mesh(tp), pool_spec())
        return JaxBlockCache(spec, num_blocks, attention, sharding=sharding)

    def make_graph_capture(self) -> GraphCapture:
        self._jax()
        from engine_plugin_tpu.graph_capture import JaxGraphCapture

        return JaxGraphCapture()

    def make_model_runner(self, model_config: ModelConfig, dtype: str) -> PlatformModelRunner | None:
        jax = self._jax()
        from engine_plugin_tpu.runner import JaxModelRunner

        tp = self.tensor_parallel_size()
        mesh = None
        impl = self.attention_impl()
        if tp > 1:
            from engine_plugin_tpu.sharding import check_tensor_parallel, make_mesh

            problems = check_tensor_parallel(model_config, tp, len(jax.devices()))
            if problems:
                raise ValueError("; ".join(problems))
            mesh = make_mesh(tp)
            # GSPMD partitions jax.numpy code by itself; a Pallas call would need shard_map around it
            impl = "jnp"
        return JaxModelRunner(
            model_config,
            dtype,
            attention_impl=impl,
            interpret=not self.on_tpu,
            head_dim_multiple=128 if self.on_tpu else 1,
            mesh=mesh,
            jit=not self.enforce_eager,
        )


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key == field:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None

"""An LLM inference and serving engine with a paged KV cache and hardware plugins."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm import LLM
    from engine.lora.request import LoRARequest
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.plugins import DeviceNotAvailableError, PluginManager, select_platform
    from engine.pooling.params import PoolingParams
    from engine.sampling.params import SamplingParams
    from engine.structured_output.params import StructuredOutputsParams

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "DeviceNotAvailableError",
    "EngineConfig",
    "LoRARequest",
    "PluginManager",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StructuredOutputsParams",
    "__version__",
    "select_platform",
]


def __getattr__(name: str) -> Any:
    # Lazy so that `import engine` (and the CLI's --version) stays cheap and imports no torch.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.sampling.params import SamplingParams

        return SamplingParams
    if name == "PoolingParams":
        from engine.pooling.params import PoolingParams

        return PoolingParams
    if name == "LoRARequest":
        from engine.lora.request import LoRARequest

        return LoRARequest
    if name == "StructuredOutputsParams":
        from engine.structured_output.params import StructuredOutputsParams

        return StructuredOutputsParams
    if name in ("CompletionOutput", "RequestOutput"):
        from engine import outputs

        return getattr(outputs, name)
    if name in ("CacheConfig", "EngineConfig", "SchedulerConfig"):
        from engine import config

        return getattr(config, name)
    if name in ("DeviceNotAvailableError", "PluginManager", "select_platform"):
        from engine import plugins

        return getattr(plugins, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")

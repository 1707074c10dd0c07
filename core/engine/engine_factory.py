"""The synchronous engine a configuration asks for: one engine, or data-parallel replicas of it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import EngineConfig

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.parallel.data_parallel import DataParallelEngine
    from engine.plugins.manager import PluginManager


def create_engine(config: EngineConfig, plugin_manager: PluginManager | None = None) -> LLMEngine | DataParallelEngine:
    """An :class:`LLMEngine` in this process, or, for ``parallel.data_parallel_size > 1``, a
    :class:`DataParallelEngine` whose replicas run in processes of their own (each loads the model).

    Raises:
        EngineConfigError: the configuration cannot run on the selected platform.
        engine.loader.errors.ModelLoadError: the model cannot be found, read or is not supported.
        engine.parallel.mp_workers.WorkerFailed: a rank or replica failed while starting (its reason).
    """
    if config.parallel.data_parallel_size > 1:
        from engine.parallel.data_parallel import DataParallelEngine

        return DataParallelEngine.start(config)
    from engine.llm_engine import LLMEngine

    return LLMEngine.from_config(config, plugin_manager)

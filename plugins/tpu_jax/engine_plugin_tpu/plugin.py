"""Pluggy hooks of the TPU/JAX plugin; importing this module must stay cheap (no JAX at import time)."""

from __future__ import annotations

from typing import Any

from engine_plugin_sdk import hookimpl

ENGINE_PLUGIN_API = ">=2.0,<3"


@hookimpl
def engine_register_platforms() -> list[type]:
    from engine_plugin_tpu.platform import TpuPlatform

    return [TpuPlatform]


@hookimpl
def engine_configure(platform: Any, config: Any) -> None:
    """Honour ``--enforce-eager`` (run steps op by op instead of compiled) on our platform."""
    from engine_plugin_tpu.platform import TpuPlatform

    if isinstance(platform, TpuPlatform):
        platform.enforce_eager = bool(getattr(config, "enforce_eager", False))

"""Pluggy hooks of the NVIDIA plugin; importing this module must stay cheap (no torch, no triton)."""

from __future__ import annotations

from engine_plugin_sdk import hookimpl

ENGINE_PLUGIN_API = ">=2.0,<3"


@hookimpl
def engine_register_platforms() -> list[type]:
    from engine_plugin_nvidia.platform import CudaPlatform

    return [CudaPlatform]

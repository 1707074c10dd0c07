"""Pluggy hooks of the Ascend plugin; importing this module stays cheap (no torch_npu, no torch)."""

from __future__ import annotations

from engine_plugin_sdk import hookimpl

ENGINE_PLUGIN_API = ">=2.0,<3"


@hookimpl
def engine_register_platforms() -> list[type]:
    from engine_plugin_ascend.platform import AscendPlatform

    return [AscendPlatform]

"""Plugin discovery (entry points + pluggy) and device selection."""

from __future__ import annotations

from engine.plugins.hookspecs import hookimpl
from engine.plugins.manager import PLUGIN_API_VERSION, PluginManager, PluginRecord
from engine.plugins.selection import DeviceNotAvailableError, select_platform

__all__ = [
    "PLUGIN_API_VERSION",
    "DeviceNotAvailableError",
    "PluginManager",
    "PluginRecord",
    "hookimpl",
    "select_platform",
]

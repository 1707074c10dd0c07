"""A complete plugin made of the reference backends, device name ``reference``.

Not an entry point: register it in-process to try the conformance suite or the engine without any
vendor plugin, e.g. ``engine conformance --device reference`` with
``ENGINE_CONFORMANCE_PLUGIN_MODULES=engine_plugin_sdk.reference_plugin``.
"""

from __future__ import annotations

from engine.plugins.hookspecs import hookimpl

ENGINE_PLUGIN_API = ">=2.0,<3"


@hookimpl
def engine_register_platforms() -> list[type]:
    from engine_plugin_sdk.reference_platform import ReferenceDevicePlatform

    return [ReferenceDevicePlatform]

"""Hook specifications a plugin module implements, grouped by lifecycle.

A plugin is a module listed under the ``engine.plugins`` entry-point group. The module declares
``ENGINE_PLUGIN_API`` (a version specifier such as ``">=2.0,<3"``) and implements some of these hooks
with :data:`hookimpl`. Importing the module must be cheap: vendor libraries are imported inside hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from engine.interfaces.platform import Platform

PROJECT_NAME = "engine"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --- registration: called once when the plugin manager loads the plugin -------------------------


@hookspec
def engine_register_platforms() -> list[type[Platform]]:
    """The platform classes this plugin provides (usually one).

    Returns:
        Subclasses of :class:`engine.interfaces.Platform`; each ``name`` must be unique across plugins.
    """


@hookspec
def engine_register_models() -> dict[str, Any]:
    """Extra model architectures, keyed by the Hugging Face ``architectures`` name.

    Returns:
        ``{architecture: model class}``; the class follows :class:`engine.models.llama.LlamaForCausalLM`'s
        constructor and forward signature.
    """


# --- engine start-up: called when an engine is built on this plugin's platform --------------------


@hookspec
def engine_configure(platform: Platform, config: Any) -> None:
    """Last chance to adjust process-wide settings (threads, allocator) before the model loads.

    Args:
        platform: the selected platform instance.
        config: the :class:`engine.config.EngineConfig` being used.
    """

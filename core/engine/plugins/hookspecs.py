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

    Called each time an engine builds its model registry. Names the core (or an earlier plugin) already
    registers are refused with a warning: a plugin adds architectures, it never replaces one.

    Returns:
        ``{architecture: model class}``; each class subclasses :class:`engine.models.base.CausalLM`
        (``engine_plugin_sdk.models.CausalLM``), which tells the loader the checkpoint's tensor names and
        shapes and gives the engine its constructor, ``load_weights``, ``forward`` and ``compute_logits``.
    """


# --- engine start-up: called when an engine is built on this plugin's platform --------------------


@hookspec
def engine_configure(platform: Platform, config: Any) -> None:
    """Last chance to adjust process-wide settings (threads, allocator) before the model loads.

    Args:
        platform: the selected platform instance.
        config: the :class:`engine.config.EngineConfig` being used.
    """

"""The TPU hardware plugin on JAX: device ``tpu``.

The entry point is :mod:`engine_plugin_tpu.plugin`; JAX is imported only inside the platform's methods
and the modules they load, so discovering the plugin never loads JAX or touches a TPU.
"""

from __future__ import annotations

__version__ = "0.1.0"

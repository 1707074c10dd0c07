"""The CPU hardware plugin: device ``cpu``, torch CPU kernels for paged attention, GEMM and the KV cache.

The entry point is :mod:`engine_plugin_cpu.plugin`; the classes live in their own modules and are
imported lazily so that discovering the plugin stays cheap.
"""

from __future__ import annotations

__version__ = "0.1.0"

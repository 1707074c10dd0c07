"""GGUF and grouped-integer weights unpacked to one code per value with their group scales: the core loader's
:mod:`engine.loader.grouped_codes` (bit for bit ``gguf.quants``' values), the form every plugin repacks from: the
Triton weight-only kernels' layout (:mod:`engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing`) and the CPU
plugin's tile records."""

from __future__ import annotations

from engine.loader.grouped_codes import (
    GGUF_GROUPED_FORMS,
    GGUF_GROUPED_SCHEMES,
    GroupedCodes,
    dequantize_codes,
    grouped_codes,
    grouped_form,
)

__all__ = [
    "GGUF_GROUPED_FORMS", "GGUF_GROUPED_SCHEMES", "GroupedCodes", "dequantize_codes", "grouped_codes", "grouped_form",
]  # fmt: skip

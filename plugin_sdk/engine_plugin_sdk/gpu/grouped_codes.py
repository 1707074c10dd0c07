"""Grouped-integer and GGUF weights unpacked to one code per value with their group scales: the core
loader's :mod:`engine.loader.grouped_codes`, the form the Triton weight-only kernels are packed from
(:func:`~engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing.pack_grouped_codes`)."""

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

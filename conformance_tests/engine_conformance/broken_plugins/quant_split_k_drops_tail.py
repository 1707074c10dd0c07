"""Broken: the int8 GEMM's split-K path (K >= 2048) loses the last split's partial sum.

Imitates a quantized kernel that switches to split-K for long reductions and launches
``K // SPLIT - 1`` splits (an off-by-one grid): small hidden sizes take the single-pass path and are
right; a 7B-class K of 4096 drops its last 1024 columns.
"""

from __future__ import annotations

from typing import Any

from engine.interfaces.gemm import GemmBackend
from engine.interfaces.platform import Capabilities
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceGemmBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"

SPLIT_K_FROM = 2048
SPLIT = 1024


class SplitKGemm(ReferenceGemmBackend):
    supported_quant_schemes: frozenset[str] = frozenset({"int8"})

    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> Any:
        k = x.shape[-1]
        if k < SPLIT_K_FROM:
            return super().linear(x, weight, bias)
        kept = (k // SPLIT - 1) * SPLIT
        return super().linear(x[..., :kept], weight[:, :kept], bias)


class QuantSplitKPlatform(ReferencePlatform):
    name = "broken-split-k"

    def capabilities(self) -> Capabilities:
        base = super().capabilities()
        return Capabilities(**{**{f: getattr(base, f) for f in base.__slots__}, "quant_schemes": ("int8",)})

    def make_gemm_backend(self) -> GemmBackend:
        return SplitKGemm()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [QuantSplitKPlatform]

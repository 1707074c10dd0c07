"""Broken: claims fp8 weights, but reads the fp8 codes without their per-channel scales."""

from __future__ import annotations

from typing import Any

from engine.interfaces.gemm import GemmBackend, QuantizedWeight
from engine.interfaces.platform import Capabilities
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceGemmBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class UnscaledFp8Gemm(ReferenceGemmBackend):
    supported_quant_schemes: frozenset[str] = frozenset({"fp8_e4m3"})

    def prepare_weight(self, weight: Any, dtype: Any) -> Any:
        if isinstance(weight, QuantizedWeight) and weight.scheme == "fp8_e4m3":
            return weight.data.to(dtype)
        return super().prepare_weight(weight, dtype)


class FakeFp8Platform(ReferencePlatform):
    name = "broken-fp8"

    def capabilities(self) -> Capabilities:
        base = super().capabilities()
        return Capabilities(
            **{**{f: getattr(base, f) for f in base.__slots__}, "quant_schemes": ("fp8_e4m3",)}
        )

    def make_gemm_backend(self) -> GemmBackend:
        return UnscaledFp8Gemm()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [FakeFp8Platform]

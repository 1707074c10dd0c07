"""Broken: the GEMM ignores its bias."""

from __future__ import annotations

from typing import Any

from engine.interfaces.gemm import GemmBackend
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceGemmBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class NoBiasGemm(ReferenceGemmBackend):
    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> Any:
        return super().linear(x, weight, None)


class DropsBiasPlatform(ReferencePlatform):
    name = "broken-bias"

    def make_gemm_backend(self) -> GemmBackend:
        return NoBiasGemm()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [DropsBiasPlatform]

"""Broken: batched LoRA scales every row's adapter update by slot 0's scale instead of its own slot's."""

from __future__ import annotations

from typing import Any

from engine.interfaces.gemm import GemmBackend
from engine.interfaces.lora import LoraWeights
from engine.interfaces.platform import Capabilities
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceGemmBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class SlotZeroScaleGemm(ReferenceGemmBackend):
    def add_lora(self, y: Any, x: Any, weights: Any, plan: Any) -> None:
        first = weights.scales[:1].expand_as(weights.scales)
        super().add_lora(y, x, LoraWeights(weights.a, weights.b, first), plan)


class SlotZeroScalePlatform(ReferencePlatform):
    name = "broken-lora-scale"

    def capabilities(self) -> Capabilities:
        base = super().capabilities()
        return Capabilities(**{**{f: getattr(base, f) for f in base.__slots__}, "lora": True})

    def make_gemm_backend(self) -> GemmBackend:
        return SlotZeroScaleGemm()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [SlotZeroScalePlatform]

"""Broken: the dense GEMM reads its activations as a contiguous ``[rows, K]`` matrix, ignoring the row stride.

Imitates a kernel launched with ``lda = K`` instead of ``x.stride(0)``: right for fresh activations,
wrong for a slice of a wider fused output (a q/k/v split, a gate/up half).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.interfaces.gemm import GemmBackend
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceGemmBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class StrideBlindGemm(ReferenceGemmBackend):
    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> Any:
        dense = x.as_strided(x.shape, torch.empty(x.shape, device="meta").stride(), x.storage_offset())
        return super().linear(dense, weight, bias)


class GemmStridesPlatform(ReferencePlatform):
    name = "broken-gemm-strides"

    def make_gemm_backend(self) -> GemmBackend:
        return StrideBlindGemm()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [GemmStridesPlatform]

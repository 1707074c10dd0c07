"""Broken: the mixture of experts runs each (token, expert) pair once, though a token may choose one
expert twice (its two weights must both count)."""

from __future__ import annotations

from typing import Any

import torch

from engine.interfaces.gemm import GemmBackend
from engine.plugins.hookspecs import hookimpl
from engine_plugin_sdk.reference_backends import ReferenceGemmBackend
from engine_plugin_sdk.reference_platform import ReferencePlatform

ENGINE_PLUGIN_API = ">=2.0,<3"


class DedupMoeGemm(ReferenceGemmBackend):
    def fused_moe(self, x: Any, experts: Any, topk_weights: Any, topk_ids: Any, activation: str = "silu") -> Any:
        weights = topk_weights.clone()
        for j in range(1, topk_ids.shape[1]):
            repeated = (topk_ids[:, j : j + 1] == topk_ids[:, :j]).any(dim=-1)
            weights[:, j] = torch.where(repeated, torch.zeros_like(weights[:, j]), weights[:, j])
        return super().fused_moe(x, experts, weights, topk_ids, activation)


class DedupMoePlatform(ReferencePlatform):
    name = "broken-moe-repeats"

    def make_gemm_backend(self) -> GemmBackend:
        return DedupMoeGemm()


@hookimpl
def engine_register_platforms() -> list[type]:
    return [DedupMoePlatform]

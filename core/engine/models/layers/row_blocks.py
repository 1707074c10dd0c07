"""A fused projection kept as row blocks: parts the GEMM backend prepared one by one.

A fused projection (q/k/v, gate/up) is one matrix when its parts stack, and its product one launch. Parts
quantized in different schemes do not stack: a GGUF Q4_K_M file stores q and k in Q4_K and v in Q6_K in
half its layers. Dequantizing such a mix to stack it would give away the packing of the whole projection;
kept apart, each part stays packed and the products are concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.interfaces.gemm import GemmBackend


@dataclass(frozen=True, slots=True)
class RowBlocks:
    """The row blocks of one projection, in output order.

    Attributes:
        parts: each block as :meth:`GemmBackend.prepare_weight` returned it.
    """

    parts: tuple[Any, ...]

    def linear(self, gemm: GemmBackend, x: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` for the stacked ``W``: one product per block, concatenated."""
        y = torch.cat([gemm.linear(x, part) for part in self.parts], dim=-1)
        return y if bias is None else y + bias

"""A fused projection kept as row blocks: parts the GEMM backend prepared one by one.

A fused projection (q/k/v, gate/up) is one matrix when its parts stack, and its product one launch. Parts
quantized in different schemes do not stack: a GGUF Q4_K_M file stores q and k in Q4_K and v in Q6_K in
half its layers. Dequantizing such a mix to stack it would give away the packing of the whole projection;
kept apart, each part stays packed and the products are concatenated, or, where the caller splits the product
at boundaries that the blocks share (q / k / v), handed out as views of the blocks' products: no concatenation
(a launch that, on GPUs, also breaks the chain of kernels that start early under programmatic dependent launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from engine.interfaces.gemm import GemmBackend


@dataclass(frozen=True, slots=True)
class RowBlocks:
    """The row blocks of one projection, in output order.

    Attributes:
        parts: each block as :meth:`GemmBackend.prepare_weight` returned it.
        rows: each block's output features.
    """

    parts: tuple[Any, ...]
    rows: tuple[int, ...]

    def linear(self, gemm: GemmBackend, x: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` for the stacked ``W``: one product per block, concatenated."""
        return torch.cat(self._products(gemm, x, bias), dim=-1)

    def _products(self, gemm: GemmBackend, x: Any, bias: torch.Tensor | None) -> list[torch.Tensor]:
        # each block's product adds its share of the bias itself (no kernel of its own for the sum)
        biases = bias.split(list(self.rows)) if bias is not None else [None] * len(self.parts)
        return [gemm.linear(x, part, b) for part, b in zip(self.parts, biases, strict=True)]

    def split_linear(
        self, gemm: GemmBackend, x: Any, sizes: list[int], bias: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """``(x @ W.T + bias).split(sizes, dim=-1)``: each piece a view of one block's product where it lies
        inside one block, else cut from the concatenation.

        Raises:
            ValueError: for sizes that do not add up to the blocks' rows.
        """
        if sum(sizes) != sum(self.rows) or min(sizes) <= 0:
            raise ValueError(f"pieces of {sizes} rows do not cover row blocks of {list(self.rows)}")
        block_ends = list(accumulate(self.rows))
        starts = [end - n for end, n in zip(accumulate(sizes), sizes, strict=True)]
        # the block each piece starts in, as (block, offset inside it)
        homes = []
        for start in starts:
            b = next(b for b, end in enumerate(block_ends) if start < end)
            homes.append((b, start - block_ends[b] + self.rows[b]))
        products = self._products(gemm, x, bias)
        if all(offset + n <= self.rows[b] for (b, offset), n in zip(homes, sizes, strict=True)):
            return [products[b][..., offset : offset + n] for (b, offset), n in zip(homes, sizes, strict=True)]
        return list(torch.cat(products, dim=-1).split(sizes, dim=-1))

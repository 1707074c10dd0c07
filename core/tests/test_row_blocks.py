"""Row blocks (a fused projection whose parts stay apart): the split product against the stacked matrix's."""

from __future__ import annotations

import pytest
import torch

from engine.models.layers.row_blocks import RowBlocks
from engine_plugin_sdk.reference_backends import ReferenceGemmBackend


def _blocks(rows: list[int], in_features: int = 24) -> tuple[RowBlocks, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(rows) * 100 + sum(rows))
    parts = [torch.randn(n, in_features, generator=gen, dtype=torch.float64) for n in rows]
    return RowBlocks(tuple(parts), tuple(rows)), torch.cat(parts)


@pytest.mark.parametrize(
    ("rows", "sizes", "shared"),
    [
        ([48, 8], [32, 16, 8], True),  # Q4_K_M's q / k in one block, v in another: views, no concatenation
        ([32, 8, 8], [32, 8, 8], True),
        ([40, 16], [32, 16, 8], False),  # k straddles two blocks: cut from the concatenation
    ],
)
def test_split_products_equal_the_stacked_matrix(rows: list[int], sizes: list[int], shared: bool) -> None:
    blocks, stacked = _blocks(rows)
    x = torch.randn(3, stacked.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(stacked.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    gemm = ReferenceGemmBackend()
    expected = (x @ stacked.T).split(sizes, dim=-1)
    pieces = blocks.split_linear(gemm, x, sizes)
    for piece, want in zip(pieces, expected, strict=True):
        torch.testing.assert_close(piece, want, rtol=1e-12, atol=1e-12)
    # views of the blocks' own products (v apart from q), or all cut from one concatenation
    storages = {piece.untyped_storage().data_ptr() for piece in pieces}
    assert len(storages) == (len(rows) if shared else 1)
    torch.testing.assert_close(blocks.linear(gemm, x, bias), x @ stacked.T + bias, rtol=1e-12, atol=1e-12)
    with_bias = blocks.split_linear(gemm, x, sizes, bias)
    for piece, want in zip(with_bias, (x @ stacked.T + bias).split(sizes, dim=-1), strict=True):
        torch.testing.assert_close(piece, want, rtol=1e-12, atol=1e-12)


def test_split_sizes_must_cover_the_blocks() -> None:
    blocks, stacked = _blocks([16, 8])
    x = torch.randn(1, stacked.shape[1], dtype=torch.float64)
    with pytest.raises(ValueError, match="do not cover row blocks"):
        blocks.split_linear(ReferenceGemmBackend(), x, [16, 4])

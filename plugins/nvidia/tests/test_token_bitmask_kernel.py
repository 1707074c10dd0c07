"""The Triton token-bitmask kernel against the float64 reference (interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from engine_plugin_sdk.gpu.triton_kernels import apply_token_bitmask
from engine_plugin_sdk.reference_ops import ref_apply_token_bitmask


def packed(allowed: torch.Tensor, words: int) -> torch.Tensor:
    """int32 ``[rows, words]`` with bit ``c % 32`` of word ``c // 32`` set where ``allowed[:, c]``."""
    rows, vocab = allowed.shape
    bits = torch.zeros(rows, 32 * words, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    words64 = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(words64 >= 2**31, words64 - 2**32, words64).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("vocab", "width", "with_indices"), [(280, 300, True), (4100, 4100, False), (64, 70, False)]
)
def test_kernel_masks_like_the_reference(device, dtype, vocab, width, with_indices):
    gen = torch.Generator().manual_seed(vocab + width)
    rows = 5
    logits = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    allowed = torch.rand(rows, vocab, generator=gen) < 0.4
    allowed[0] = False
    allowed[0, vocab - 1] = True  # one token only: the last of the vocabulary
    allowed[1] = True
    bitmask = packed(allowed, -(-vocab // 32))
    indices = torch.tensor([0, 1, 3]) if with_indices else None
    want = ref_apply_token_bitmask(logits, bitmask, indices)
    got = logits.to(device)
    apply_token_bitmask(got, bitmask.to(device), indices.to(device) if indices is not None else None)
    assert got.dtype == dtype
    assert torch.equal(got.double().cpu(), want)


def test_kernel_masks_a_strided_row_view(device):
    # the engine masks a slice of wider logits (rows of a batch); the row stride must be honoured
    wide = torch.randn(3, 96).to(device)
    view = wide[:, :70]
    bitmask = packed(torch.rand(3, 64) < 0.5, 2)
    want = ref_apply_token_bitmask(view.cpu(), bitmask, None)
    apply_token_bitmask(view, bitmask.to(device))
    assert torch.equal(view.double().cpu(), want)
    assert torch.isfinite(wide[:, 70:]).all()

"""Integer codes packed into int32 words, as GPTQ, AWQ and compressed-tensors store them, and act-order
column orders (``g_idx``) turned into the plugin API's ``perm``."""

from __future__ import annotations

import torch

from engine.loader.errors import ModelLoadError

#: AWQ packs eight output columns into a word in this order: nibble ``k`` holds column ``AWQ_ORDER[k]``
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes out of int32 words along ``dim`` (element ``k`` of a word at bits ``k * bits``, low first).

    Args:
        packed: int32 words.
        bits: 4 or 8.
        dim: 0 or 1, the dimension the words pack.

    Returns:
        int32 unsigned codes, ``dim`` ``32 / bits`` times longer.
    """
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32)
    if dim == 0:
        words = words.T
    codes = ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)
    assert codes.shape[-1] == words.shape[-1] * per_word
    return codes.T if dim == 0 else codes


def undo_awq_order(codes: torch.Tensor) -> torch.Tensor:
    """Columns unpacked in AWQ's word order (``[rows, cols]``) put back in their own order."""
    rows, cols = codes.shape
    order = torch.tensor(AWQ_ORDER).repeat(cols // 8) + torch.arange(0, cols, 8).repeat_interleave(8)
    restored = torch.empty_like(codes)
    restored[:, order] = codes
    return restored


def act_order(g_idx: torch.Tensor | None, in_features: int, group_size: int, name: str) -> torch.Tensor | None:
    """The stored column order for a ``g_idx`` (each input feature's group), None when groups are the
    plain runs of ``group_size`` columns.

    Raises:
        ModelLoadError: a group without exactly ``group_size`` members.
    """
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, torch.arange(in_features) // group_size):
        return None
    counts = torch.bincount(g_idx, minlength=in_features // group_size)
    if counts.numel() != in_features // group_size or bool((counts != group_size).any()):
        raise ModelLoadError(f"tensor '{name}': g_idx does not give every group {group_size} input features")
    return torch.argsort(g_idx, stable=True)

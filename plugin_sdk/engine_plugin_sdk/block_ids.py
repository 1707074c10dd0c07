"""Checking the block-id pairs a :class:`~engine.interfaces.block_cache.BlockCache` is asked to copy or swap."""

from __future__ import annotations

import torch


def block_id_pairs(
    pairs: list[tuple[int, int]], src_limit: int, dst_limit: int, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination block ids of ``(src, dst)`` pairs, as int64 CPU tensors, range-checked.

    Args:
        pairs: a non-empty list of ``(source block, destination block)``.
        src_limit: source ids must be in ``[0, src_limit)``.
        dst_limit: destination ids must be in ``[0, dst_limit)``.
        what: the operation, for the error message (``"copy_blocks"``, ``"swap_out"``, ...).

    Returns:
        ``(src, dst)``, contiguous.

    Raises:
        ValueError: for an id out of range or a destination named twice (a copy would then depend on order).
    """
    index = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    src, dst = index[:, 0], index[:, 1]
    if int(src.min()) < 0 or int(src.max()) >= src_limit:
        raise ValueError(f"{what}: source block ids must be in [0, {src_limit}), got {src.tolist()}")
    if int(dst.min()) < 0 or int(dst.max()) >= dst_limit:
        raise ValueError(f"{what}: destination block ids must be in [0, {dst_limit}), got {dst.tolist()}")
    if dst.unique().numel() != dst.numel():
        raise ValueError(f"{what}: a destination block appears more than once: {dst.tolist()}")
    return src.contiguous(), dst.contiguous()

"""Dtype names as the contract spells them (``"bfloat16"``, ``"float8_e4m3fn"``) and the torch dtypes behind them."""

from __future__ import annotations

from typing import Any

import torch

#: cache dtypes stored as FP8 (keys and values unscaled)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def torch_dtype(dtype: Any, supported: tuple[str, ...] | None = None) -> torch.dtype:
    """The torch dtype for a dtype name or a torch dtype.

    Args:
        dtype: a name such as ``"float32"`` (or ``"torch.float32"``), or a ``torch.dtype``.
        supported: when given, the names the caller runs; any other dtype is refused.

    Returns:
        The torch dtype.

    Raises:
        ValueError: for a name torch does not know, or one outside ``supported``.
    """
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
    if supported is not None and dtype_name(resolved) not in supported:
        raise ValueError(f"unsupported dtype {dtype_name(resolved)!r}; supported: {list(supported)}")
    return resolved


def dtype_name(dtype: Any) -> str:
    """The contract's name of a torch dtype or a dtype name (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def as_copyable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or for an FP8 tensor its uint8 view (same bytes): torch's ``index_select`` and
    ``index_copy_`` do not take FP8 tensors."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES else tensor

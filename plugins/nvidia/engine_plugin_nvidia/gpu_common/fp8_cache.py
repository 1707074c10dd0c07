"""The FP8 KV cache's dtypes, and the byte view torch's indexed copies need for them.

Imports torch only, so both the Triton launchers and the block cache can share it.
"""

from __future__ import annotations

import torch

#: cache dtypes stored as FP8 (keys and values unscaled); the attention kernels read them through fp16
FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)


def as_copyable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or for an FP8 tensor its uint8 view (same bytes): torch's index_select and
    index_copy_ do not take FP8 tensors."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_CACHE_DTYPES else tensor

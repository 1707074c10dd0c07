"""Structured output's token mask: logits of the tokens a packed bitmask disallows set to ``-inf``, in place.

One program masks one block of columns of one row; the row comes from the indices when only some rows
of the batch are constrained, so unconstrained rows cost nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.pdl import pdl_begin

#: columns per program: a 49k vocabulary is 12 programs a row, each reading 128 words of bitmask
BLOCK = 4096


# the widths and strides follow the model's vocabulary and the structured-output manager's bitmask, which need
# not share their divisibility with the start-up warm-up's (engine.warm_up): one variant serves them all
@triton.jit(do_not_specialize=["stride_logits", "stride_bitmask", "width", "num_words"])
def apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    indices_ptr,
    stride_logits,
    stride_col,
    stride_bitmask,
    width,
    num_words,
    HAS_INDICES: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    if HAS_INDICES:
        row = tl.load(indices_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < width
    # columns past the bitmask (a padded logits width) read a zero word: disallowed
    words = tl.load(
        bitmask_ptr + row * stride_bitmask + cols // 32, mask=in_row & (cols < num_words * 32), other=0
    )
    allowed = ((words >> (cols % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + cols * stride_col, neg_inf, mask=in_row & ~allowed)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Set the logits of the tokens ``bitmask`` disallows to ``-inf``, in place (the core op's contract:
    bit ``j`` of word ``w`` allows column ``32 * w + j``; columns past ``32 * words`` are disallowed).

    Args:
        logits: float ``[rows, width]``, any strides.
        bitmask: int32 ``[rows, words]`` on the logits' device.
        indices: int rows to mask, or None for every row.

    Raises:
        ValueError: for logits that are not a 2-D tensor, or a bitmask of the wrong dtype or row count.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, width], got {tuple(logits.shape)}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"bitmask must be int32 [{logits.shape[0]}, words], got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    rows = logits.shape[0] if indices is None else indices.numel()
    if rows == 0 or logits.shape[1] == 0:
        return
    grid = (rows, -(-logits.shape[1] // BLOCK))
    apply_token_bitmask_kernel[grid](
        logits, bitmask, indices if indices is not None else bitmask,
        logits.stride(0), logits.stride(1), bitmask.stride(0), logits.shape[1], bitmask.shape[1],
        HAS_INDICES=indices is not None, BLOCK=BLOCK, num_warps=8, **pdl.launch_options(),
    )  # fmt: skip

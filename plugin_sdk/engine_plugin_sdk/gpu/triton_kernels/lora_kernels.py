"""Batched LoRA (:mod:`engine.interfaces.lora`): ``y[t] += scales[s] * (x[t] @ a[s].T) @ b[s].T`` for
``s = token_slots[t] >= 0``, in two SGMV-style kernels.

- **shrink**: one program per (slot, block of rows, split of the reduction). It reads the block's slots
  first and leaves at once when no row of the block has its slot, so a slot that no row names costs one
  small load; otherwise it multiplies the block's rows of that slot by the slot's ``A`` (the rank padded to
  a power of two by masks) and writes the scaled float32 partial sums of its split.
- **expand**: one program per (slot, block of rows, block of output columns), the same early exit. It adds
  up the splits' partial sums of its rows, multiplies them by a ``[BLOCK_N, rank]`` tile of the slot's ``B``
  and adds the result to ``y`` in place. Every row has one slot, so exactly one program writes each
  element of ``y``: no atomics, and the sum's order is fixed.

Both kernels walk the rows in the plan's order (sorted by slot, ``order``), so a block of rows holds one
slot or a few and the programs of the other slots leave at once; ``slots`` is read in that order too.
Rows of other slots are masked out of every load and store, so each program reads only its own rows of
``x``, the partial sums and ``y``. The grids depend only on the number of rows and the shapes, and nothing
is read back to the host: the pair can be recorded in a CUDA graph and replayed with other slots. Inside a
graph they take programmatic dependent launch like the other kernels here (:mod:`.pdl`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.pdl import pdl_begin


@triton.jit
def _rows_of_slot(slots_ptr, offs_m, M, slot):
    """Which of the block's rows run under ``slot`` (rows past ``M`` never do)."""
    row_slot = tl.load(slots_ptr + offs_m, mask=offs_m < M, other=-1)
    return row_slot == slot


@triton.jit
def lora_shrink_kernel(
    x_ptr, a_ptr, scale_ptr, slots_ptr, order_ptr, part_ptr,
    M, K, RANK, k_per_split, stride_xm, stride_as, stride_ar, stride_ps, stride_pm,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """``part[split, i, :] = scales[s] * x[order[i], cols] @ a[s, :, cols].T`` over the split's columns, for
    the block's positions ``i`` whose slot is ``s = pid(0)``.

    ``x`` is ``[M, K]``, ``a`` ``[slots, RANK, K]``, ``scale`` float32 ``[slots]``, ``slots`` int32 ``[M]``
    (position ``i``'s slot, in the sorted order), ``order`` int32 ``[M]`` (position ``i``'s row of ``x``),
    ``part`` float32 ``[splits, M, BLOCK_R]`` (columns past ``RANK`` get zeros). With ``DOT_F32`` both
    operands are multiplied in float32 (float32 inputs, or ``x`` and ``a`` of different dtypes);
    otherwise ``a`` is cast to ``x``'s dtype.
    """
    slot = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # before the first read: the slots and x come from earlier kernels
    pdl_begin(USE_PDL)
    mine = _rows_of_slot(slots_ptr, offs_m, M, slot)
    # most (slot, block) pairs hold no row at decode: one load of the slots and out
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < RANK
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.load(order_ptr + offs_m, mask=mine, other=0)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    # A's tile loaded transposed, [BLOCK_K, BLOCK_R], so the product needs no register shuffle
    a_cols = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        cols = k0 + offs_k
        k_ok = cols < k_end
        xt = tl.load(x_rows + cols[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_cols + cols[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(xt, at.to(xt.dtype), acc)
    acc = acc * tl.load(scale_ptr + slot)
    out = (
        part_ptr + pid_k.to(tl.int64) * stride_ps + offs_m.to(tl.int64)[:, None] * stride_pm + offs_r[None, :]
    )
    tl.store(out, acc, mask=mine[:, None])


@triton.jit
def lora_expand_kernel(
    part_ptr, b_ptr, slots_ptr, order_ptr, y_ptr,
    M, N, RANK, splits, stride_ps, stride_pm, stride_bs, stride_bn, stride_ym,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """``y[order[i], cols] += sum_split(part[split, i, :]) @ b[s, cols, :].T`` for the block's positions
    ``i`` whose slot is ``s = pid(0)`` and the output columns ``cols`` of block ``pid(2)``.

    ``part`` is from :func:`lora_shrink_kernel` (``splits`` of them, at most ``SPLIT``), ``b``
    ``[slots, N, RANK]``, ``y`` ``[M, N]`` in any float dtype (added to in float32). The shrunk rows are
    rounded to ``b``'s dtype for the product unless ``DOT_F32`` (as the torch default does).
    """
    slot = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # before the first read: the slots, the partial sums and y come from earlier kernels
    pdl_begin(USE_PDL)
    mine = _rows_of_slot(slots_ptr, offs_m, M, slot)
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < RANK
    parts = part_ptr + offs_m.to(tl.int64)[:, None] * stride_pm + offs_r[None, :]
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # unrolled, so that the splits' loads are all in flight at once rather than one latency each
    for split in tl.static_range(SPLIT):
        # splits past ``splits`` as a bound on the rows: the interpreter cannot broadcast a scalar mask
        live = mine & (offs_m < tl.where(split < splits, M, 0))
        h += tl.load(parts + split * stride_ps, mask=live[:, None], other=0.0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # B's tile transposed, [BLOCK_R, BLOCK_N]: padded rank rows read as zeros
    bt = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + offs_n.to(tl.int64)[None, :] * stride_bn + offs_r[:, None],
        mask=r_ok[:, None] & n_ok[None, :], other=0.0,
    )  # fmt: skip
    if DOT_F32:
        acc = tl.dot(h, bt.to(tl.float32), input_precision=PRECISION)
    else:
        acc = tl.dot(h.to(bt.dtype), bt)
    rows = tl.load(order_ptr + offs_m, mask=mine, other=0)
    y_tile = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    y_ok = mine[:, None] & n_ok[None, :]
    y = tl.load(y_tile, mask=y_ok, other=0.0)
    tl.store(y_tile, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_ok)

"""Host side of the batched LoRA kernels (:mod:`.lora_kernels`): tiles, the reduction split and the grids.

Everything chosen here depends on the number of rows and the weights' shapes only, never on the slots'
values, so a launch recorded in a CUDA graph stays valid for any assignment of rows to slots.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from engine.interfaces.lora import LoraWeights
from engine_plugin_sdk.gpu.triton_kernels import lora_kernels as lk
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.launch import next_power_of_2

#: ``tl.dot`` takes tiles of 16 at least in every dimension
MIN_DOT = 16


@dataclass(frozen=True, slots=True)
class LoraTiles:
    """Launch parameters of the LoRA kernels on one target.

    Attributes:
        block_m: ``(max_rows, block_m)`` by the number of rows: the first entry whose ``max_rows`` covers
            them (the last one past them all); 16 at least (``tl.dot``'s smallest tile).
        block_k: reduction columns per step of the shrink.
        block_n: output columns per expand program.
        num_warps: warps per program (both kernels).
        num_stages: pipelining depth of the shrink's reduction loop.
        min_programs_per_slot: split the shrink's reduction until a slot's row blocks times the splits
            reach this many programs (at decode one slot's rows are one block: unsplit, a single
            multiprocessor would stream the slot's whole ``A``) ...
        max_split_k: ... into at most this many splits (each split's partial sums are re-read by every
            expand program of its rows) ...
        min_split_blocks: ... of at least this many ``block_k`` steps each.
        stage_bytes: most bytes of one shrink pipeline stage (an ``x`` and an ``A`` tile): narrows
            ``block_k`` for tall row blocks, float32 inputs and wide ranks, so that ``num_stages`` of them
            fit in shared memory (an MI300's LDS is 64 KiB).
        b_tile_elems: most elements of an expand program's ``B`` tile: narrows ``block_n`` for wide ranks.
    """

    block_m: tuple[tuple[int, int], ...] = ((16, 16), (32, 32), (0, 64))
    block_k: int = 128
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    min_programs_per_slot: int = 16
    max_split_k: int = 16
    min_split_blocks: int = 1
    stage_bytes: int = 16384
    b_tile_elems: int = 8192

    def rows_block(self, rows: int) -> int:
        """``block_m`` for ``rows`` rows."""
        for max_rows, block in self.block_m[:-1]:
            if rows <= max_rows:
                return block
        return self.block_m[-1][1]

    def shrink_block_k(self, block_m: int, block_r: int, x_bytes: int, a_bytes: int, in_features: int) -> int:
        """The shrink's reduction step: ``block_k`` within ``stage_bytes``, never wider than the reduction
        rounded up to a power of two, 16 at least (``tl.dot``)."""
        fits = floor_power_of_2(self.stage_bytes // (block_m * x_bytes + block_r * a_bytes))
        return max(MIN_DOT, min(self.block_k, fits, next_power_of_2(in_features)))

    def expand_block_n(self, block_r: int, out_features: int) -> int:
        """The expand's output columns per program: ``block_n`` within ``b_tile_elems``, 16 at least."""
        fits = floor_power_of_2(self.b_tile_elems // block_r)
        return max(MIN_DOT, min(self.block_n, fits, next_power_of_2(out_features)))

    def split_k(self, row_blocks: int, k_blocks: int) -> int:
        """Into how many splits the shrink's ``k_blocks`` reduction steps go for ``row_blocks`` blocks."""
        want = min(self.max_split_k, triton.cdiv(self.min_programs_per_slot, max(1, row_blocks)))
        return max(1, min(want, k_blocks // max(1, self.min_split_blocks)))


#: meant for an H200 (and used on every GPU): chosen by reasoning about decode batches (a slot's ``A`` of
#: 4096 x 16 in 16 splits of 256 columns, ``B`` in tiles of 128 output rows), not yet measured there
#: (``benchmarks/lora_kernel_bench.py`` times them)
H200_LORA_TILES = LoraTiles()
#: the interpreter runs each program's tile ops as numpy calls: few, large tiles and no split keep it quick
#: (and it has no shared memory to fit)
INTERPRETER_LORA_TILES = LoraTiles(
    block_k=256, block_n=256, num_stages=1, max_split_k=1, stage_bytes=1 << 20, b_tile_elems=1 << 16
)


def default_lora_tiles() -> LoraTiles:
    """The interpreter's tiles under ``TRITON_INTERPRET=1``, else the GPU's."""
    return INTERPRETER_LORA_TILES if os.environ.get("TRITON_INTERPRET", "") == "1" else H200_LORA_TILES


def floor_power_of_2(n: int) -> int:
    """The largest power of two <= n (1 for n < 2)."""
    return 1 << max(0, n.bit_length() - 1)


def lora_rank_block(rank: int) -> int:
    """The rank padded to what ``tl.dot`` takes: a power of two, 16 at least."""
    return max(MIN_DOT, next_power_of_2(rank))


@dataclass(frozen=True, slots=True)
class SortedLoraRows:
    """A step's rows in slot order, made once per step (:func:`sort_lora_rows`) and read by every launch.

    Attributes:
        slots: int32 ``[rows]``, the slots in ascending order (rows without one, ``-1``, first).
        order: int32 ``[rows]``, the row each sorted position stands for.
    """

    slots: torch.Tensor
    order: torch.Tensor


def sort_lora_rows(token_slots: torch.Tensor) -> SortedLoraRows:
    """Rows sorted by slot on the device (stable; nothing read back, so it may be recorded in a graph)."""
    slots, order = torch.sort(token_slots.to(torch.int32), stable=True)
    return SortedLoraRows(slots.contiguous(), order.to(torch.int32).contiguous())


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    weights: LoraWeights,
    token_slots: torch.Tensor | SortedLoraRows,
    tiles: LoraTiles | None = None,
) -> None:
    """``y[t] += scales[s] * (x[t] @ a[s].T) @ b[s].T`` for ``s = token_slots[t] >= 0``, in place.

    Args:
        y: ``[rows, out_features]`` (float32 / float16 / bfloat16; float32 for logits).
        x: ``[rows, in_features]`` (float32 / float16 / bfloat16).
        weights: the projection's slots: ``a [slots, rank, in]``, ``b [slots, out, rank]``, float32
            ``scales [slots]``; any rank (padded to a power of two in the kernels).
        token_slots: int32 ``[rows]`` on ``y``'s device, ``-1`` for a row without an adapter (other integer
            dtypes are converted on the device), or the step's rows already sorted by slot
            (:func:`sort_lora_rows`; a bare tensor is sorted here, on the device).
        tiles: launch parameters; :func:`default_lora_tiles` when None.

    Raises:
        ValueError: for shapes that do not fit together.
    """
    a, b, scales = weights.a, weights.b, weights.scales
    num_slots, rank, in_features = a.shape
    out_features = b.shape[1]
    rows = x.shape[0]
    if x.dim() != 2 or x.shape[1] != in_features or tuple(y.shape) != (rows, out_features):
        raise ValueError(
            f"LoRA of {tuple(x.shape)} into {tuple(y.shape)} with A {tuple(a.shape)} / B {tuple(b.shape)}"
        )
    if tuple(b.shape) != (num_slots, out_features, rank) or scales.numel() != num_slots:
        raise ValueError(
            f"LoRA B {tuple(b.shape)} / scales {tuple(scales.shape)} do not fit A {tuple(a.shape)}"
        )
    sorted_rows = token_slots if isinstance(token_slots, SortedLoraRows) else sort_lora_rows(token_slots)
    if sorted_rows.slots.numel() != rows:
        raise ValueError(f"token_slots has {sorted_rows.slots.numel()} entries for {rows} rows")
    if rows == 0 or num_slots == 0 or rank == 0 or out_features == 0:
        return
    tiles = tiles or default_lora_tiles()
    x, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, a, b))
    slots, order = sorted_rows.slots, sorted_rows.order
    scales = scales.to(torch.float32).contiguous()
    # the kernel writes through y's row stride; a y it cannot address that way is updated through a copy
    target = y if y.stride(-1) == 1 else y.contiguous()
    block_m = tiles.rows_block(rows)
    block_r = lora_rank_block(rank)
    block_k = tiles.shrink_block_k(block_m, block_r, x.element_size(), a.element_size(), in_features)
    block_n = tiles.expand_block_n(block_r, out_features)
    row_blocks = triton.cdiv(rows, block_m)
    k_blocks = triton.cdiv(in_features, block_k)
    blocks_per_split = triton.cdiv(k_blocks, tiles.split_k(row_blocks, k_blocks))
    splits = triton.cdiv(k_blocks, blocks_per_split)
    # float32 partial sums; only rows that have a slot are written, and only they are read back
    part = torch.empty((splits, rows, block_r), dtype=torch.float32, device=x.device)
    shrink_f32 = x.dtype == torch.float32 or a.dtype != x.dtype
    lk.lora_shrink_kernel[(num_slots, row_blocks, splits)](
        x, a, scales, slots, order, part,
        rows, in_features, rank, blocks_per_split * block_k, x.stride(0), a.stride(0), a.stride(1),
        part.stride(0), part.stride(1),
        DOT_F32=shrink_f32, PRECISION="ieee", BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl.launch_options(),
    )  # fmt: skip
    lk.lora_expand_kernel[(num_slots, row_blocks, triton.cdiv(out_features, block_n))](
        part, b, slots, order, target,
        rows, out_features, rank, splits, part.stride(0), part.stride(1), b.stride(0), b.stride(1),
        target.stride(0),
        SPLIT=next_power_of_2(splits), DOT_F32=b.dtype == torch.float32, PRECISION="ieee", BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_R=block_r, num_warps=tiles.num_warps, **pdl.launch_options(),
    )  # fmt: skip
    if target is not y:
        y.copy_(target)

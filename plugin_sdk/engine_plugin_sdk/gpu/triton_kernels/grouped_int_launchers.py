"""Host side of the grouped-integer weight-only GEMM and GEMVs (:mod:`.grouped_int_kernels`,
:mod:`.grouped_int4_gemv_kernels`): the load-time repacking, tiles, grids, and the choice of a kernel by the
number of activation rows (the few-row tensor-core kernels' launchers and the split-K sums are in
:mod:`.grouped_int4_few_rows_launchers`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from engine.interfaces.gemm import QuantizedWeight
from engine.interfaces.grouped_int import unpack_int4
from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.gpu.grouped_codes import GroupedCodes, dequantize_codes, grouped_codes
from engine_plugin_sdk.gpu.triton_kernels import grouped_int4_gemv_kernels as g4
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_kernels as gk
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.grouped_int4_few_rows_launchers import (
    FRAGMENT_MAX_ROWS,
    fragment_fits,
    fragment_linear,
    mma_fits,
    mma_linear,
    split_result,
    split_target,
)

#: ``tl.dot`` takes a reduction of 16 at least; a 4-bit tile holds two halves of it
MIN_BLOCK_K = {4: 32, 8: 16}


@dataclass(frozen=True, slots=True)
class GroupedIntTiles:
    """Launch parameters of the grouped-integer GEMM on one target.

    Attributes:
        block_k: reduction columns per tile, fixed at load (the 4-bit codes are paired within blocks of
            it); capped at the largest power of two dividing the weight's group size.
        fp32_block_k: the same for float32 activations, whose tiles take twice the shared memory (at
            128 the larger tiles outgrow an MI300's 64 KiB of LDS).
        gemm: ``(max_rows, block_m, block_n, num_warps, num_stages)`` by the number of activation rows: the
            first entry whose ``max_rows`` covers them (the last one past them all). ``block_m`` is at
            least 16 (``tl.dot``'s smallest tile).
        min_programs: split the reduction until the output tiles times the splits reach this many
            programs (about two per multiprocessor), ...
        max_split_k: ... into at most this many splits ...
        min_split_blocks: ... of at least this many ``block_k`` tiles each.
        gemv: ``(rows, row_bytes, num_warps, num_stages)`` of the single-row GEMV over 8-bit codes: output
            features per program (1, 2 or 4 unrolled; a larger power of two as one tile, for the
            interpreter), and code bytes of each row read per iteration (a power of two; fewer where a row
            has fewer).
        gemv4: the same for 4-bit codes packed in blocks of ``gemv4_min_block`` columns or more (their own
            kernel, :mod:`.grouped_int4_gemv_kernels`); narrower blocks take ``gemv`` and the byte kernel.
        gemv4_min_block: see ``gemv4``.
        gemv_loop_stages: the unrolled GEMVs' reduction loop past its first tile pipelined this deep by Triton
            (``tl.range``'s ``num_stages``: ``cp.async`` copies through shared memory, ``stages - 1`` iterations
            ahead). The launch's ``num_stages`` in ``gemv`` / ``gemv4`` does not reach a loop without a
            ``tl.dot``, so with 1 each iteration waits for its own tiles.
        dense_rows: products of at least this many rows dequantize the weight into a dense copy in the
            activations' dtype and run the vendor's GEMM on it (0: never). Past some hundreds of rows the
            copy's bytes cost less than dequantizing a tile once per tile of rows inside the grouped GEMM.
        mma_rows: products of 2 to this many bf16 / fp16 rows over 4-bit codes in blocks of
            ``gemv4_min_block`` columns or more take the tensor-core kernel (:mod:`.grouped_int4_mma_kernels`;
            0: never, the default, since its fast path is NVIDIA PTX).
        mma: ``(block_n, num_warps, num_stages)`` of that kernel.
        mma_programs: it splits the reduction until its row tiles times the splits reach this many programs
            (at most ``max_split_k`` splits of ``min_split_blocks`` blocks or more).
        mma_asm: the tensor-core kernels run their inline PTX (the interpreter runs plain ops instead).
        fragment_rows: products of ``fragment_min_rows`` to this many (at most 8) bf16 / fp16 rows over
            4-bit codes in blocks of 128 columns or more take the fragment kernel
            (:mod:`.grouped_int4_fragment_kernels`: each word of codes read straight into a tensor-core
            operand) ahead of the GEMVs and ``mma``; 0: never (the default: its fast path is NVIDIA PTX).
        fragment_min_rows: see ``fragment_rows``.
        fragment_warps: warps of its programs (each program 16 output features, its warps splitting the
            reduction) ...
        fragment_narrow_warps: ... or this many when the product has fewer than ``fragment_narrow_programs``
            programs (fewer output features: more warps keep the GPU's memory busy).
        fragment_narrow_programs: see ``fragment_narrow_warps``.
        fragment_depth: how many of its warp's iterations ahead the fragment kernel reads a chunk's words
            (1-3; each further one holds a chunk more in flight through an iteration, for 8 registers a lane).
        fragment_narrow_depth: ... and this many for products of fewer than ``fragment_narrow_programs`` programs
            (0: ``fragment_depth``). 1 made qkv / o_proj / down faster alone at 4 rows on an H100 but W4A16 decode
            of 2 / 4 / 8 sequences 4-6% slower (2026-12-05): inside the graphs the PDL prologue's two chunks pay.
        fragment_stages: 2 or more: the fragment kernel's chunks past the first go through Triton's pipeliner
            instead (``cp.async`` copies into shared memory ``stages - 1`` iterations ahead: bytes in flight
            without registers; ``fragment_depth`` and ``fragment_ahead`` unread); 0: off. Nsight Compute on an
            H100 (2026-12-05) found the kernel waiting on its words' loads at the occupancy its registers and
            grid allow. Not yet timed.
        fragment_ahead: the fragment kernel reads each chunk's group scales with its words (``fragment_depth``
            iterations ahead) and its activations one iteration ahead; without it ptxas issues the scales'
            loads amid the iteration that multiplies by them (about 6 registers a lane more at depth 2). Off:
            on an H100 (2026-12-05) down_proj alone ran 6-13% faster, gate_up 1-18% and the LM head up to 9%
            slower, and W4A16 decode of 4 sequences 4.5% slower; Nsight Compute put the kernel's stalls on the words' loads
            (long scoreboard) at the low occupancy of narrow products, not on the scales.
        gated_epilogue: the fewest activation rows whose gate/up product applies its gated activation in the
            product's own launch (:func:`grouped_int_gated_linear`: the fragment kernel's 1-8 rows, or with 1
            the GEMVs' single row too; 0: never, the activation kernel after the product). At one row the GEMVs
            ran slower with it (2026-12-05, an H100: W4A16 / Q4_K_M decode 1.0 / 1.0-1.7% slower: a program's
            rows are two pairs far apart), 2-8 rows about as fast or 1.4-2.5% faster, hence 2.
    """

    block_k: int = 128
    fp32_block_k: int = 32
    gemm: tuple[tuple[int, int, int, int, int], ...] = (
        (16, 16, 64, 4, 4), (32, 32, 64, 4, 4), (64, 64, 64, 4, 3), (256, 64, 128, 4, 3), (0, 128, 128, 8, 3),
    )  # fmt: skip
    min_programs: int = 264
    max_split_k: int = 16
    min_split_blocks: int = 2
    gemv: tuple[int, int, int, int] = (4, 1024, 4, 2)
    gemv4: tuple[int, int, int, int] = (4, 2048, 4, 2)
    gemv4_min_block: int = 128
    gemv_loop_stages: int = 1
    dense_rows: int = 128
    mma_rows: int = 0
    mma: tuple[int, int, int] = (64, 4, 3)
    mma_programs: int = 528
    mma_asm: bool = True
    fragment_rows: int = 0
    fragment_min_rows: int = 1
    fragment_warps: int = 4
    fragment_narrow_warps: int = 8
    fragment_narrow_programs: int = 1024
    fragment_depth: int = 1
    fragment_narrow_depth: int = 0
    fragment_stages: int = 0
    fragment_ahead: bool = False
    gated_epilogue: int = 2

    def gemm_tiles(self, rows: int) -> tuple[int, int, int, int]:
        """``(block_m, block_n, num_warps, num_stages)`` for ``rows`` activation rows."""
        for max_rows, *tiles in self.gemm[:-1]:
            if rows <= max_rows:
                return tuple(tiles)  # type: ignore[return-value]
        return tuple(self.gemm[-1][1:])  # type: ignore[return-value]

    def split_k(self, output_tiles: int, k_blocks: int) -> int:
        """How many programs share one output tile's ``k_blocks`` reduction tiles."""
        want = min(self.max_split_k, triton.cdiv(self.min_programs, max(1, output_tiles)))
        return max(1, min(want, k_blocks // max(1, self.min_split_blocks)))


#: the defaults, meant for an H200 (132 SMs: ``min_programs`` is two programs each) and used on every GPU.
#: From 128 rows the dense copy and cuBLAS win (2026-12-03, Llama-3-8B shapes, W4A16 and Q4_K): at 256 rows
#: 41 against 65-88 us (qkv) and 187 against 230-308 us (gate_up); at 8192 rows 0.60 against 1.1-1.6 ms
#: (qkv), within 2-6% of bf16; at 64 rows the grouped GEMM still wins (31 against 35 us, 115 against 164).
#: The GEMM's tiles were chosen by analogy with the MoE GEMM's and are not tuned (at 256 rows it ran at
#: 120-210 TFLOP/s on an H200 against cuBLAS bf16's 450-590). The GEMV's (4 rows, 1 KiB a row) took the
#: least time over a layer's four products, W4A16 and Q4_K, of the variants timed there (1-16 rows,
#: 256 B-4 KiB a row, 4 or 8 warps); 2 KiB a row was 5% faster on the LM head, 20% slower on down_proj.
#: The 4-bit word GEMV's (4 rows, 2 KiB a row, 4 warps) took the least time over a layer's four W4A16
#: products (2026-12-03: 72 us against 77-84 for 1 KiB a row or 2 warps, and 86 for the byte GEMV); on
#: Q4_K_M's 32-column blocks it made batch-1 decode slower (215 against about 280 tok/s), hence the minimum
#: block width (`gemv4_min_block`).
#: The tensor-core kernel for 2-16 rows (64 rows a program, 3 stages; 2026-12-04, one bf16 product of
#: Llama-3-8B shapes at 4 rows, split as ``mma_programs`` picks) took 11.6 / 9.2 / 38.8 / 21.9 / 150 us
#: (qkv / o_proj / gate_up / down / lm_head) against the grouped GEMM's 24.0 / 16.4 / 71.7 / 42.6 / 258. At
#: one row it lost to the word GEMV (gate_up 37.7 against 34.1 us).
#: The fragment kernel for 2-8 rows (2026-12-05, `benchmarks/nvidia_h200_word_gemv.py --rows 1 2 4 8`, one bf16
#: product, CUDA graphs over weight copies past the L2 cache, us at 4 rows, one zero point / zero scales):
#: qkv 10.6 / 11.1 against the tensor-core kernel's 14.7 / 17.1, o_proj 8.9 / 9.1 against 12.0 / 13.8, gate_up
#: 28.1 / 36.8 against
#: 43.0 / 54.1, down 19.2 / 19.2 against 25.0 / 32.7, lm_head 107.5 / 137.6 against 145.0 / 210.0; 4 warps
#: a program where there are 1,024 programs or more (gate_up, lm_head: 8 warps took 41 / 155 us), 8 below
#: (o_proj, down: 4 warps took 10.0 / 28.8 us). At one row it beat the word GEMV on gate_up and the LM head
#: with one zero point (27.0 / 97.8 against 29.3 / 120.4) but lost on qkv, o_proj, down (10.3-10.7 / 8.5-9.8 /
#: 18.7 against 8.5 / 6.2 / 17.3) and with zero scales, so one row stays on the word GEMV.
#: Reading two iterations ahead (``fragment_depth=2``; 2026-12-05, an H100, the device lent that day): a layer's
#: four products at 4 rows 85.3 -> 76.4 us with 3 ahead (gate_up 43.0 -> 36.6); W4A16 decode of 2 / 4 / 8
#: sequences 628 / 1,276 / 2,377 -> 693 / 1,360 / 2,609 tok/s (2 ahead) and 678 / 1,351 / 2,579 (3 ahead) in
#: the same calls; 2 takes fewer registers (66 against 76 for down_proj's shape). To confirm on an H200.
H200_GROUPED_INT_TILES = GroupedIntTiles(mma_rows=16, fragment_rows=8, fragment_min_rows=2, fragment_depth=2)
#: the interpreter runs each program's tile ops as numpy calls: few, large tiles and no split keep it quick
#: (GGUF's 32-column groups cap the reduction tile at 32: 512 output columns a program against 256 halved
#: a 4096-wide product's time there, each numpy call costing about the same whatever its tile)
INTERPRETER_GROUPED_INT_TILES = GroupedIntTiles(
    block_k=128, fp32_block_k=128, gemm=((16, 16, 512, 4, 1), (0, 64, 512, 4, 1)), max_split_k=1,
    gemv=(64, 1024, 4, 1), gemv4=(64, 1024, 4, 1), mma_rows=16, mma_asm=False, fragment_rows=8, fragment_min_rows=2,
    fragment_warps=2, fragment_narrow_warps=2,
)


def grouped_int_block_k(group_size: int, bits: int, block_k: int) -> int | None:
    """The tile's reduction width for a group size: ``block_k`` capped at the largest power of two that
    divides the group, or None when that is below what ``tl.dot`` takes (the weight is then dequantized)."""
    width = min(block_k, group_size & -group_size)
    return width if width >= MIN_BLOCK_K[bits] else None


def pack_grouped_int(weight: QuantizedWeight, block_k: int, device: torch.device) -> GroupedIntWeight:
    """Repack an ``int4_grouped`` / ``int8_grouped`` weight, or a GGUF weight of a type the kernels take
    (:data:`~engine_plugin_sdk.gpu.grouped_codes.GGUF_GROUPED_FORMS`), into the kernels' layout on ``device``.

    Args:
        weight: the weight in the plugin API's layout (:mod:`engine.interfaces.grouped_int`, or GGUF blocks).
        block_k: the kernels' reduction sub-block: a power of two dividing the group size, at least
            :data:`MIN_BLOCK_K` of the bit width (:func:`grouped_int_block_k`).
        device: where the packed weight goes (and where GGUF blocks are unpacked).

    Returns:
        The packed weight (see :func:`pack_grouped_codes`).

    Raises:
        ValueError: for another scheme, a ``block_k`` that does not fit the group size, or parts whose
            shapes do not match the weight's.
    """
    return pack_grouped_codes(grouped_codes(weight, device), block_k, device)


def pack_grouped_codes(codes: GroupedCodes, block_k: int, device: torch.device) -> GroupedIntWeight:
    """Pack unpacked codes into the kernels' layout on ``device``.

    Args:
        codes: one code per value and the group parameters.
        block_k: as for :func:`pack_grouped_int`.
        device: where the packed weight goes.

    Returns:
        The packed weight: codes row-major, 4-bit codes paired within each ``block_k`` columns; scales and
        zero scales ``[out, groups]`` in float16 where that is exact, else float32; an int32 ``perm`` or None.

    Raises:
        ValueError: for a ``block_k`` that does not divide the group size or is below :data:`MIN_BLOCK_K`.
    """
    bits, group = codes.bits, codes.group_size
    out_features, in_features = (int(d) for d in codes.codes.shape)
    if group <= 0 or in_features % group or group % block_k or block_k < MIN_BLOCK_K[bits]:
        raise ValueError(f"block_k {block_k} does not fit {in_features} columns in groups of {group} ({bits}-bit)")
    values = codes.codes.to(device=device, dtype=torch.uint8)
    if bits == 4:
        pairs = values.reshape(out_features, in_features // block_k, 2, block_k // 2)
        values = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(out_features, in_features // 2)
    perm = None if codes.perm is None else codes.perm.to(device=device, dtype=torch.int32).contiguous()
    zero_scales = None if codes.zero_scales is None else _narrowest(codes.zero_scales.to(device))
    return GroupedIntWeight(
        codes=values.contiguous(),
        scales=_narrowest(codes.scales.to(device)),
        zero_scales=zero_scales,
        perm=perm,
        bits=bits,
        group_size=group,
        block_k=block_k,
        shape=(out_features, in_features),
        zero_point=codes.zero_point,
    )


def dequantize_packed(weight: GroupedIntWeight) -> torch.Tensor:
    """float32 ``[out, in]`` of a packed weight in stored column order, by the kernels' formula (for checks)."""
    out_features, in_features = weight.shape
    codes = weight.codes
    if weight.bits == 4:
        half = weight.block_k // 2
        split = unpack_int4(codes).reshape(out_features, in_features // weight.block_k, half, 2)
        codes = split.transpose(-1, -2).reshape(out_features, in_features)
    unpacked = GroupedCodes(
        codes, weight.scales.float(), None if weight.zero_scales is None else weight.zero_scales.float(),
        weight.zero_point, weight.bits, weight.group_size,
    )  # fmt: skip
    return dequantize_codes(unpacked)


def dequantize_grouped(weight: GroupedIntWeight, dtype: torch.dtype, block_n: int = 32) -> torch.Tensor:
    """``[out, in]`` in ``dtype`` of a packed weight in stored column order, on its device (by a kernel).

    Args:
        weight: from :func:`pack_grouped_int`.
        dtype: the copy's dtype (the activations').
        block_n: rows per program.

    Returns:
        A new contiguous tensor.
    """
    out_features, in_features = weight.shape
    out = torch.empty((out_features, in_features), dtype=dtype, device=weight.codes.device)
    scales = weight.scales
    gk.grouped_int_dequant_kernel[(triton.cdiv(out_features, block_n), in_features // weight.block_k)](
        weight.codes, scales, weight.zero_scales if weight.zero_scales is not None else scales, out,
        out_features, weight.codes.stride(0), scales.stride(0), out.stride(0),
        GROUP=weight.group_size, BITS=weight.bits, ZERO=weight.zero_point, HAS_ZS=weight.zero_scales is not None,
        BLOCK=weight.block_k, BLOCK_N=block_n,
    )  # fmt: skip
    return out


def _narrowest(values: torch.Tensor) -> torch.Tensor:
    """float16 when it holds every value exactly (half the bytes the kernels stream), else float32."""
    values = values.float().contiguous()
    half = values.half()
    return half if torch.equal(half.float(), values) else values


def grouped_int_linear(
    x: torch.Tensor,
    weight: GroupedIntWeight,
    bias: torch.Tensor | None,
    tiles: GroupedIntTiles,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x[..., perm] @ dequant(W).T + bias``: one row through the GEMV, more through the GEMM (plus a sum
    over splits of its reduction).

    Args:
        x: ``[..., in_features]`` activations (float32 / float16 / bfloat16).
        weight: from :func:`pack_grouped_int`.
        bias: ``[out_features]`` or None.
        tiles: launch parameters (``tiles.block_k`` is not read: the weight's own was fixed at load).
        out_dtype: the result's dtype; ``x``'s when None (the logits ask for float32).

    Returns:
        ``[..., out_features]`` in ``out_dtype``.

    Raises:
        ValueError: when ``x``'s last dimension is not the weight's ``in_features``.
    """
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"activations of width {x.shape[-1]} for a weight of {in_features} input features")
    dtype = out_dtype or x.dtype
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if 0 < tiles.dense_rows <= m and dtype == rows.dtype:
        if weight.perm is not None:
            rows = rows.index_select(1, weight.perm)
        dense = torch.nn.functional.linear(rows, dequantize_grouped(weight, rows.dtype), bias)
        return dense.reshape(*x.shape[:-1], out_features)
    out = torch.empty((m, out_features), dtype=dtype, device=x.device)
    if max(1, tiles.fragment_min_rows) <= m <= min(tiles.fragment_rows, FRAGMENT_MAX_ROWS) and fragment_fits(
        rows, weight
    ):
        fragment_linear(rows, weight, bias, tiles, out)
    elif m == 1:
        _gemv(rows, weight, bias, tiles, out)
    elif m <= tiles.mma_rows and mma_fits(rows, weight, tiles):
        out = mma_linear(rows, weight, bias, tiles, out)
    elif m > 0:
        out = _gemm(rows, weight, bias, tiles, out)
    return out.reshape(*x.shape[:-1], out_features)


def grouped_int_gated_linear(
    x: torch.Tensor, weight: GroupedIntWeight, activation: int, tiles: GroupedIntTiles
) -> torch.Tensor | None:
    """``act(x @ G.T) * (x @ U.T)`` of a weight stacking the gate's rows ``G`` over the up rows ``U``, in one
    launch of the fragment kernel or the word GEMV where they take ``x``'s rows (else None: the caller runs the
    product, then the activation).

    Args:
        x: ``[..., in_features]`` activations.
        weight: from :func:`pack_grouped_int`, an even number of output features.
        activation: :data:`.elementwise_kernels.SILU` or ``GELU_TANH``.
        tiles: launch parameters.

    Returns:
        ``[..., out_features / 2]`` in ``x``'s dtype, or None.
    """
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    if not 0 < tiles.gated_epilogue <= rows.shape[0] or out_features % 2 or x.shape[-1] != in_features:
        return None
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, out_features // 2), dtype=x.dtype, device=x.device)
    if max(1, tiles.fragment_min_rows) <= m <= min(tiles.fragment_rows, FRAGMENT_MAX_ROWS) and fragment_fits(
        rows, weight
    ):
        fragment_linear(rows, weight, None, tiles, out, activation)
    elif m == 1 and _gemv_tile(weight, tiles)[0] == 4:
        _gemv(rows, weight, None, tiles, out, activation)
    else:
        return None
    return out.reshape(*x.shape[:-1], out_features // 2)


def gemv_subs(weight: GroupedIntWeight, row_bytes: int) -> int:
    """Sub-blocks of ``weight.block_k`` columns the GEMV reads per iteration: ``row_bytes`` of codes of a
    row, a power of two, no more than the row holds."""
    block_bytes = weight.block_k // 2 if weight.bits == 4 else weight.block_k
    blocks = weight.shape[1] // weight.block_k
    return max(1, min(triton.next_power_of_2(max(1, row_bytes // block_bytes)), triton.next_power_of_2(blocks)))


def _gemv_tile(weight: GroupedIntWeight, tiles: GroupedIntTiles) -> tuple[int, int, int, int]:
    """``(rows, row_bytes, warps, stages)`` of the GEMV that takes ``weight``: the word GEMV's for 4-bit codes
    in wide blocks, else the byte GEMV's."""
    return tiles.gemv4 if weight.bits == 4 and weight.block_k >= tiles.gemv4_min_block else tiles.gemv


def _gemv(
    row: torch.Tensor,
    weight: GroupedIntWeight,
    bias: torch.Tensor | None,
    tiles: GroupedIntTiles,
    out: torch.Tensor,
    gated: int = gk.NOT_GATED,
) -> None:
    """One activation row ``[1, K]`` into ``out [1, N]`` (with ``gated``, at 4 rows a program only:
    ``act(gate) * up`` into ``out [1, N / 2]``)."""
    out_features, in_features = weight.shape
    words = weight.bits == 4 and weight.block_k >= tiles.gemv4_min_block
    rows, row_bytes, warps, stages = _gemv_tile(weight, tiles)
    if rows not in (1, 2, 4) and (rows < 4 or rows & (rows - 1)):
        raise ValueError(f"the GEMV runs 1, 2, 4 or a larger power of two rows a program, not {rows}")
    subs = gemv_subs(weight, row_bytes)
    blocks = in_features // weight.block_k
    unused = weight.scales  # any pointer: unread without HAS_ZS / HAS_PERM / HAS_BIAS
    args = (
        row, weight.codes, weight.scales, weight.zero_scales if weight.zero_scales is not None else unused,
        weight.perm if weight.perm is not None else unused, bias.contiguous() if bias is not None else unused, out,
        out_features, weight.codes.stride(0), weight.scales.stride(0),
    )  # fmt: skip
    common = {
        "NUM_BLOCKS": blocks, "GROUP": weight.group_size, "ZERO": weight.zero_point,
        "HAS_ZS": weight.zero_scales is not None, "HAS_PERM": weight.perm is not None, "HAS_BIAS": bias is not None,
        "BLOCK": weight.block_k, "ROWS": rows, "SUBS": subs, "EVEN": blocks % subs == 0,
        "num_warps": warps, "num_stages": stages, **pdl.launch_options(),
    }  # fmt: skip
    # 4-bit codes against 16-bit activations take the unrolled kernels' path without a subtraction per code
    # (its float32 sums carry terms up to 256 times an activation, held to about 2**-16 of it; for 8-bit
    # codes it ran more instructions than the subtraction saves)
    high = weight.bits == 4 and row.dtype in (torch.bfloat16, torch.float16)
    if rows <= 4:
        common["HIGH"] = high
        common["LOOP_STAGES"] = tiles.gemv_loop_stages
    grid = (triton.cdiv(out_features, rows),)
    if gated != gk.NOT_GATED:
        # two features a program: their gate rows and their up rows
        grid, common["GATED"] = (triton.cdiv(out_features // 2, 2),), gated
    # up to four rows unrolled (the GPU's), more as one tile (the interpreter's): see the kernels
    if rows > 4:
        gk.grouped_int_gemv_wide_kernel[grid](*args, BITS=weight.bits, **common)
    elif words:
        g4.grouped_int4_gemv_kernel[grid](*args, g4.FLOAT_ONE_BITS if high else g4.FLOAT_2_23_BITS, **common)
    else:
        gk.grouped_int_gemv_kernel[grid](*args, BITS=weight.bits, **common)


def _gemm(
    rows: torch.Tensor, weight: GroupedIntWeight, bias: torch.Tensor | None, tiles: GroupedIntTiles, out: torch.Tensor
) -> torch.Tensor:
    """``rows [M, K]`` into ``out [M, N]`` (returned; a new tensor when the reduction is split)."""
    out_features, in_features = weight.shape
    m = rows.shape[0]
    block_m, block_n, warps, stages = tiles.gemm_tiles(m)
    k_blocks = in_features // weight.block_k
    output_tiles = triton.cdiv(m, block_m) * triton.cdiv(out_features, block_n)
    blocks_per_split = triton.cdiv(k_blocks, tiles.split_k(output_tiles, k_blocks))
    splits = triton.cdiv(k_blocks, blocks_per_split)
    target = split_target(out, splits)
    unused = weight.scales  # any pointer: unread without HAS_ZS / HAS_PERM / HAS_BIAS
    gk.grouped_int_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(out_features, block_n), splits)](
        rows, weight.codes, weight.scales, weight.zero_scales if weight.zero_scales is not None else unused,
        weight.perm if weight.perm is not None else unused, bias.contiguous() if bias is not None else unused, target,
        m, out_features, blocks_per_split * weight.block_k, rows.stride(0), weight.codes.stride(0),
        weight.scales.stride(0), target.stride(-2), target.stride(0) if splits > 1 else 0,
        K=in_features, GROUP=weight.group_size, BITS=weight.bits, ZERO=weight.zero_point,
        HAS_ZS=weight.zero_scales is not None, HAS_PERM=weight.perm is not None,
        HAS_BIAS=bias is not None and splits == 1,
        PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=weight.block_k, num_warps=warps, num_stages=stages,
        **pdl.launch_options(),
    )  # fmt: skip
    return split_result(out, target, splits, bias)

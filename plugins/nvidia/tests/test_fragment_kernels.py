"""The 4-bit fragment kernel (:mod:`engine_plugin_sdk.gpu.triton_kernels.grouped_int4_fragment_kernels`): each
word of codes read straight into a warp ``mma``'s operands, for blocks of 128 columns or more (the scales off
the ``mma``'s sums) and of 32 / 64 columns (the scales in the operands), against float64 (interpreter on the
CPU: the ``mma`` emulated lane by lane)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_launchers as launchers
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import grouped_int_linear
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import dequantize_packed, pack_grouped_codes
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import (
    H200_GROUPED_INT_TILES,
    INTERPRETER_GROUPED_INT_TILES,
    GroupedIntTiles,
)
from engine_plugin_sdk.grouped_codes import GroupedCodes
from engine_plugin_sdk.tolerances import compare, get_tolerance


def tiles_for(device: torch.device) -> GroupedIntTiles:
    return INTERPRETER_GROUPED_INT_TILES if device.type == "cpu" else H200_GROUPED_INT_TILES


def _packed_codes(
    gen: torch.Generator, out_features: int, in_features: int, block: int, zero_scales: bool, act_order: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, GroupedIntWeight, torch.Tensor | None]:  # fmt: skip
    """Random 4-bit codes in blocks (and groups) of ``block`` columns with a zero point or zero scales, and
    act-order: the codes, their scales, the packed weight and the permutation (or None)."""
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    scales = torch.rand(out_features, in_features // block, generator=gen) * 0.05 + 0.01
    zs = torch.rand(out_features, in_features // block, generator=gen) * 0.2 if zero_scales else None
    perm = torch.randperm(in_features, generator=gen) if act_order else None
    unpacked = GroupedCodes(codes, scales, zs, 0 if zero_scales else 8, 4, block, perm)
    return codes, scales, pack_grouped_codes(unpacked, block, device), perm


def _count_fragment_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each fragment-kernel launch."""
    calls: list[int] = []
    real = launchers.fragment_linear
    monkeypatch.setattr(launchers, "fragment_linear", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize(
    ("zero_scales", "block", "depth", "ahead", "prefetch"),
    [
        (False, 128, 1, False, 0), (True, 128, 1, False, 0), (False, 256, 1, False, 0), (True, 256, 1, False, 0),
        (False, 128, 3, False, 0), (True, 256, 2, False, 0), (False, 128, 2, True, 0), (True, 128, 3, True, 0),
        (True, 256, 2, True, 0), (False, 256, 1, True, 0), (False, 128, 2, False, 2), (True, 256, 1, False, 8),
    ],
)  # fmt: skip
def test_fragment_kernel_reads_words_into_tensor_core_operands(
    device, zero_scales: bool, block: int, depth: int, ahead: bool, prefetch: int, monkeypatch
) -> None:
    """1 to 8 bf16 / fp16 rows over 4-bit codes in blocks of 128 columns or more take the fragment kernel (its
    ``mma`` PTX on a GPU, the same slots emulated lane by lane in the interpreter; bf16 too, as no ``tl.dot``
    runs there): against float64 with act-order, bias, a zero point or zero scales, an odd number of chunks
    for its warps (or an even one), output features past the last full tile of 16, and words read 1-3
    iterations ahead (with their scales, and the activations one ahead: ``ahead``), with L2 prefetches past the
    read-ahead (``prefetch``; on a GPU one past the last chunk would read past the weight)."""
    gen = torch.Generator().manual_seed(29)
    # reading ahead: enough chunks that every register set of the read-ahead takes its turn; with ``ahead`` and
    # 128 columns a block an even number of chunks too (the read-ahead past the last chunk reads the last again)
    blocks = 3 if depth == 1 else 8 if ahead and block == 128 and zero_scales else 7
    in_features, out_features = blocks * block, 24
    codes, scales, prepared, perm = _packed_codes(gen, out_features, in_features, block, zero_scales, block == 128,
                                                  device)  # fmt: skip
    calls = _count_fragment_launches(monkeypatch)
    tiles = dataclasses.replace(
        tiles_for(device), fragment_rows=8, fragment_min_rows=1, fragment_warps=2, fragment_depth=depth,
        fragment_ahead=ahead, fragment_prefetch=prefetch, fragment_narrow_blocks=False,
    )
    for dtype in (torch.float16, torch.bfloat16):
        for rows in (1, 3, 8):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            bias = torch.randn(out_features, generator=gen).to(dtype)
            got = grouped_int_linear(x.to(device), prepared, bias.to(device), tiles)
            assert got.dtype == dtype and got.shape == (rows, out_features)
            xs = x.double() if perm is None else x.double()[:, perm]
            want = xs @ dequantize_packed(prepared).double().cpu().T + bias.double()
            problem = compare(got, want, get_tolerance(dtype), f"fragments {dtype} M={rows} block={block}")
            assert not problem, problem
    assert len(calls) == 6
    # 9 rows, float32 activations, and blocks of 64 columns (without fragment_narrow_blocks) take the other kernels
    x = torch.randn(9, in_features, generator=gen).to(device)
    grouped_int_linear(x.half(), prepared, None, tiles)
    grouped_int_linear(x[:1], prepared, None, tiles)
    narrow = pack_grouped_codes(GroupedCodes(codes, scales.repeat_interleave(block // 64, 1), None, 8, 4, 64), 64, device)
    grouped_int_linear(x[:1].half(), narrow, None, tiles)
    assert len(calls) == 6


@pytest.mark.parametrize(
    ("zero_scales", "block", "depth", "gated"),
    [(False, 32, 1, False), (True, 32, 2, False), (True, 64, 1, False), (False, 64, 3, False), (True, 32, 2, True)],
)  # fmt: skip
def test_fragment_kernel_takes_narrow_blocks_into_its_operands(
    device, zero_scales: bool, block: int, depth: int, gated: bool, monkeypatch
) -> None:
    """With ``fragment_narrow_blocks``, 4-bit codes in blocks of 32 / 64 columns (GGUF's, GPTQ's small groups)
    take the fragment kernel, each lane's block scales (and zero scales) in its operands: against float64 for
    1 / 3 / 8 rows of fp16 and bf16 (a bf16 operand is the dequantized weight rounded once), with a gate/up
    product fused and act-order (``gated``), an odd chunk count for the warps, and features past the last tile
    of 16."""
    gen = torch.Generator().manual_seed(31 + block + depth)
    in_features, out_features = 5 * 128, 24
    # act-order with the gated product (GPTQ's small groups)
    codes, _, prepared, perm = _packed_codes(gen, out_features, in_features, block, zero_scales, gated, device)
    calls = _count_fragment_launches(monkeypatch)
    tiles = dataclasses.replace(
        tiles_for(device), fragment_rows=8, fragment_min_rows=1, fragment_warps=2, fragment_narrow_warps=2,
        fragment_depth=depth, fragment_narrow_blocks=True,
    )
    # the operands the kernel multiplies: each weight (code - zero) * scale - zero scale rounded once to the
    # 16-bit type, its scale and zero scale rounded first (a bf16 operand is off the exact weight by up to 2**-9)
    wide = block * torch.ones(in_features // block, dtype=torch.long)
    for dtype in (torch.float16, torch.bfloat16):
        s16 = prepared.scales.cpu().float().to(dtype).double().repeat_interleave(wide, 1)
        z16 = prepared.zero_scales.cpu().float().to(dtype).double().repeat_interleave(wide, 1) if zero_scales else 0.0
        dense = ((codes.double() - (0 if zero_scales else 8)) * s16 - z16).to(dtype).double()
        for rows in (1, 3, 8):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            y = (x.double() if perm is None else x.double()[:, perm]) @ dense.T
            if gated:
                got = launchers.grouped_int_gated_linear(x.to(device), prepared, 0, tiles)
                half = out_features // 2
                want = y[:, :half] * torch.sigmoid(y[:, :half]) * y[:, half:]
            else:
                got, want = grouped_int_linear(x.to(device), prepared, None, tiles), y
            assert got is not None and got.dtype == dtype
            problem = compare(got, want, get_tolerance(dtype), f"narrow fragments {dtype} M={rows} block={block}")
            assert not problem, problem
    assert len(calls) == 6

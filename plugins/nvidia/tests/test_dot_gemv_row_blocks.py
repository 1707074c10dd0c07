"""A projection of two row blocks in different code forms (GGUF Q4_K_M's q / k in Q4_K over v in Q6_K) in one
launch of the integer-dot GEMV (``dot_gemv_row_blocks``): the joined row equals the blocks' own products side
by side bit for bit, through each form the second block may take, program-order parameters or row-major, with a
bias and in either 16-bit dtype; the backend joins only grouped-integer blocks of one width, and a joined weight
goes through the backend's other products (gated, more rows, a first block of partial programs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_plugin_sdk.gpu.gemm import GroupedIntRowBlocks, TorchGemmBackend
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import grouped_int_linear
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import pack_grouped_int
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_row_blocks_launchers import (
    one_launch,
    row_blocks_linear,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import (
    H200_GROUPED_INT_TILES,
    INTERPRETER_GROUPED_INT_TILES,
    GroupedIntTiles,
)
from engine_plugin_sdk.quant import make_quantized_weight

#: (first block's scheme, second's, the second in 6-bit codes): Q4_K_M's q/k over v (v in 8- and 6-bit codes),
#: Q4_0's one zero point over Q8_0's 8-bit codes
PAIRS = (("gguf_q4_k", "gguf_q6_k", False), ("gguf_q4_k", "gguf_q6_k", True), ("gguf_q4_0", "gguf_q8_0", False))
K = 256
#: each scheme's packing block (Q6_K's groups are 16 columns)
BLOCK = {"gguf_q4_k": 32, "gguf_q6_k": 16, "gguf_q4_0": 32, "gguf_q8_0": 32}


def _tiles(device: torch.device, program_params: bool, on: bool = True) -> GroupedIntTiles:
    base = INTERPRETER_GROUPED_INT_TILES if device.type == "cpu" else H200_GROUPED_INT_TILES
    return dataclasses.replace(
        base, dot_gemv_rows=8, dot_gemv_warps=1, dot_gemv_8bit=True, mma_asm=device.type != "cpu",
        dot_gemv_program_params=program_params, dot_gemv_row_blocks=on, dot_gemv_residual_norm=False,
    )  # fmt: skip


def _blocks(pair: tuple[str, str, bool], rows: tuple[int, int], seed: int, device: torch.device) -> GroupedIntRowBlocks:
    first, second, six_bit = pair
    parts = tuple(
        pack_grouped_int(make_quantized_weight(scheme, n, K, seed=seed + i), BLOCK[scheme], device,
                         six_bit=six_bit and i == 1)  # fmt: skip
        for i, (scheme, n) in enumerate(zip((first, second), rows, strict=True))
    )
    return GroupedIntRowBlocks(parts, rows)


def _side_by_side(x: torch.Tensor, weight: GroupedIntRowBlocks, bias: torch.Tensor | None, tiles: GroupedIntTiles):
    biases = bias.split(list(weight.rows)) if bias is not None else [None] * len(weight.parts)
    return torch.cat([grouped_int_linear(x, p, b, tiles) for p, b in zip(weight.parts, biases, strict=True)], dim=-1)


def test_one_launch_gives_the_blocks_products(device) -> None:
    """Each pair, program-order parameters in bf16 with a bias and row-major ones in fp16 without: the one launch's
    row is the two launches' bit for bit (the second block's 20 rows end in a partial program)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    for pair in PAIRS:
        weight = _blocks(pair, (32, 20), int(gen.seed() % (1 << 20)), device)
        for program_params, dtype, with_bias in ((True, torch.bfloat16, True), (False, torch.float16, False)):
            tiles = _tiles(device, program_params)
            x = torch.randn(1, K, generator=gen).to(dtype).to(device)
            bias = torch.randn(52, generator=gen).to(dtype).to(device) if with_bias else None
            assert one_launch(x, weight, tiles), pair
            got = row_blocks_linear(x, weight, bias, tiles)
            want = _side_by_side(x, weight, bias, tiles)
            assert got.shape == (1, 52) and torch.equal(got, want), (pair, program_params, dtype)


def test_other_rows_and_shapes_take_a_product_a_block(device) -> None:
    """Three rows, a first block of partial programs (20 rows at 8 a program) and the tiles' switch off take a
    product a block into the one output: the same values as side by side."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    weight = _blocks(PAIRS[0], (32, 16), int(gen.seed() % (1 << 20)), device)
    partial = _blocks(PAIRS[0], (20, 16), int(gen.seed() % (1 << 20)), device)
    tiles = _tiles(device, True)
    x3 = torch.randn(3, K, generator=gen).to(torch.float16).to(device)
    x1 = x3[:1]
    assert not one_launch(x3, weight, tiles)
    assert not one_launch(x1, partial, tiles)
    assert not one_launch(x1, weight, _tiles(device, True, on=False))
    for x, w in ((x3, weight), (x1, partial)):
        torch.testing.assert_close(row_blocks_linear(x, w, None, tiles), _side_by_side(x, w, None, tiles), rtol=0, atol=0)


def test_backend_joins_grouped_blocks_of_one_width(device) -> None:
    """``join_row_blocks``: grouped-integer blocks of one input width joined where one launch takes them; a float
    block, blocks of two widths, rows that do not match, a first block of partial programs or tiles without the
    one launch are left apart (None). The joined weight through ``linear`` (one row, a prompt's
    rows) and ``gated_linear`` (a gate/up pair: the product, then the activation) against its blocks'."""
    if device.type == "cpu":
        pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    backend = TorchGemmBackend("cuda" if device.type == "cuda" else "cpu")
    backend.triton_grouped_int = backend.triton_gated = True
    backend.grouped_int_tiles = _tiles(device, True)
    weight = _blocks(PAIRS[0], (32, 32), int(gen.seed() % (1 << 20)), device)
    assert backend.join_row_blocks(weight.parts, weight.rows) == weight
    dense = torch.randn(32, K, generator=gen).to(device)
    narrow = pack_grouped_int(make_quantized_weight("gguf_q8_0", 32, 128, seed=3), 32, device)
    assert backend.join_row_blocks((weight.parts[0], dense), (32, 32)) is None
    assert backend.join_row_blocks((weight.parts[0], narrow), (32, 32)) is None
    assert backend.join_row_blocks(weight.parts, (32, 31)) is None
    partial = _blocks(PAIRS[0], (20, 16), int(gen.seed() % (1 << 20)), device)
    assert backend.join_row_blocks(partial.parts, partial.rows) is None  # no one launch: the core's views
    # tiles that take no one launch keep the blocks apart: the core's views of their products copy nothing
    backend.grouped_int_tiles = _tiles(device, True, on=False)
    assert backend.join_row_blocks(weight.parts, weight.rows) is None
    backend.grouped_int_tiles = _tiles(device, True)
    for rows in (1, 3):
        x = torch.randn(rows, K, generator=gen).to(torch.float16).to(device)
        want = _side_by_side(x, weight, None, backend.grouped_int_tiles)
        assert torch.equal(backend.linear(x, weight), want), rows
        gate, up = want.float().chunk(2, dim=-1)
        gated = backend.gated_linear(x, weight, "silu").float()
        torch.testing.assert_close(gated, torch.nn.functional.silu(gate) * up, rtol=2e-3, atol=2e-3)

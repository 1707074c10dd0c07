"""The AMX dense product (``csrc/dense_amx.c``) against float64, its weight layout, and the GEMM backend's
use of it; the kernel tests are skipped where the CPU has no AMX-BF16 tiles."""

from __future__ import annotations

import pytest
import torch
from amx_test_kernels import amx_kernels

from engine_plugin_cpu.amx_kernels import AmxWeight, amx_packable, pack_amx_weight, unpack_amx_weight
from engine_plugin_cpu.gemm import CpuGemmBackend
from engine_plugin_cpu.native_kernels import NativeKernels
from engine_plugin_sdk.reference_ops import ref_linear, ref_linear_activation

#: bf16 inputs and output: a bf16 rounding of the largest output, plus the tanh GELU's 4.7e-4
REL_TOL = 1e-2


@pytest.fixture(scope="module")
def tiles() -> NativeKernels:
    yield from amx_kernels()


def _operands(rows: int, width: int, out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(out, width, generator=gen) * width**-0.5).to(torch.bfloat16)
    bias = torch.randn(out, generator=gen).to(torch.bfloat16)
    return x, weight, bias


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert (got.double() - expected).abs().max() <= REL_TOL * expected.abs().max()


@pytest.mark.parametrize("out", [32, 40, 96, 33])
def test_the_tile_layout_round_trips_exactly(out: int) -> None:
    weight = _operands(1, 64, out, seed=out)[1]
    packed = pack_amx_weight(weight)
    assert packed.tiles.shape == (-(-out // 32), 2, 2, 16, 32)
    assert torch.equal(unpack_amx_weight(packed), weight)
    # tile (pair 0, chunk 0, tile 1), row 3: inner elements 6 and 7 of output columns 16..31, interleaved
    assert torch.equal(packed.tiles[0, 0, 1, 3].view(16, 2), torch.stack([weight[16:32, 6], weight[16:32, 7]], 1))


def test_only_bf16_matrices_whose_width_comes_in_32s_pack() -> None:
    assert amx_packable(torch.zeros(8, 64, dtype=torch.bfloat16))
    assert not amx_packable(torch.zeros(8, 48, dtype=torch.bfloat16))
    assert not amx_packable(torch.zeros(8, 64))


@pytest.mark.parametrize(
    ("rows", "width", "out"),
    [
        (1, 64, 40),  # one row (decode): a padded block, columns split over the threads
        (5, 96, 33),  # a partial last column pair
        (37, 128, 96),  # a whole row block and a partial one
        (300, 384, 1152),  # bge-small's q/k/v shape, shortened
        (64, 1536, 64),  # a long inner dimension: 48 tile steps a pair
    ],
)
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_the_product_against_float64(tiles: NativeKernels, rows: int, width: int, out: int, activation: str) -> None:
    x, weight, bias = _operands(rows, width, out, seed=rows + width + out)
    packed = pack_amx_weight(weight)
    got = tiles.dense(x, packed, bias, activation)
    expected = ref_linear(x, weight, bias) if activation == "none" else ref_linear_activation(x, weight, bias, "gelu")
    _close(got, expected)
    # no bias, and rows of a wider tensor (a strided view, as a fused projection's slice)
    wide = torch.cat([x, torch.randn(rows, 32).to(torch.bfloat16)], 1)[:, :width]
    _close(tiles.dense(wide, packed, None), ref_linear(x, weight, None))


def test_a_result_does_not_depend_on_the_thread_count(tiles: NativeKernels) -> None:
    x, weight, bias = _operands(200, 256, 160, seed=3)
    packed = pack_amx_weight(weight)
    single = amx_kernels(threads=1)
    one = next(single)
    assert torch.equal(one.dense(x, packed, bias, "gelu"), tiles.dense(x, packed, bias, "gelu"))
    single.close()
    # batched rows keep their leading shape; no rows give no rows
    assert tiles.dense(x.view(2, 100, 256), packed, bias).shape == (2, 100, 160)
    assert tiles.dense(x[:0], packed, bias).shape == (0, 160)


def test_bad_operands_are_refused(tiles: NativeKernels) -> None:
    x, weight, bias = _operands(4, 64, 32, seed=5)
    packed = pack_amx_weight(weight)
    with pytest.raises(ValueError, match="bf16 rows of 64"):
        tiles.dense(x.float(), packed, bias)
    with pytest.raises(ValueError, match="bf16 rows of 64"):
        tiles.dense(x[:, :32], packed, bias)
    with pytest.raises(ValueError, match="unknown activation"):
        tiles.dense(x, packed, bias, "silu")


def test_the_gemm_backend_packs_bf16_weights_for_the_tiles(tiles: NativeKernels) -> None:
    """With the AMX kernels, a dense bf16 weight is packed as tiles and ``linear`` / ``linear_activation``
    run on them; a width that is not in 32s, a float32 model and a backend without prepacking keep
    their previous layouts."""
    backend = CpuGemmBackend(native=tiles)
    x, weight, bias = _operands(70, 128, 96, seed=11)
    prepared = backend.prepare_weight(weight.float(), torch.bfloat16)
    assert isinstance(prepared, AmxWeight)
    _close(backend.linear(x, prepared, bias), ref_linear(x, weight, bias))
    _close(backend.linear_activation(x, prepared, bias, "gelu"), ref_linear_activation(x, weight, bias, "gelu"))
    _close(backend.logits(x, prepared).to(torch.bfloat16), ref_linear(x, weight, None))
    with pytest.raises(ValueError, match="bf16 activations"):
        backend.linear(x.float(), prepared, bias)
    assert not isinstance(backend.prepare_weight(torch.randn(8, 48), torch.bfloat16), AmxWeight)
    assert not isinstance(backend.prepare_weight(weight.float(), torch.float32), AmxWeight)
    assert not isinstance(CpuGemmBackend(prepack=False, native=tiles).prepare_weight(weight, torch.bfloat16), AmxWeight)

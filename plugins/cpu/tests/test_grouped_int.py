"""Grouped-int weights (GPTQ / AWQ layout) on the packed GGUF kernels, against the float64 product.

Every repack path (symmetric int4 -> Q4_0, asymmetric int4 -> Q4_1, symmetric int8 -> Q8_0) must give a
packed weight, so that a silent fall back to dequantizing fails here; the weights it cannot hold exactly
(act-order, small groups, fp16-inexact parameters, asymmetric int8) must give the dense weight instead.
Inputs are fresh random draws; the seed is in every failure message.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine_plugin_cpu.gemm import CpuGemmBackend, PackedWeight
from engine_plugin_cpu.grouped_int import repack_grouped_as_gguf
from engine_plugin_cpu.native_build import load_native
from engine_plugin_cpu.native_kernels import NativeKernels
from engine_plugin_sdk import QuantizedWeight, grouped_int_weight
from engine_plugin_sdk.quant import make_quantized_weight
from engine_plugin_sdk.tolerances import compare, get_tolerance

IN_FEATURES = 256
#: not a multiple of 16: torch's int4 kernel pads rows, which must be sliced off again
OUT_FEATURES = 100
#: a decode row, a few, and a batch past every packed/dense-copy crossover (2 / 12 / 24 / 32 rows)
ROW_COUNTS = (1, 7, 40)
#: the repack paths: (bits, symmetric) -> the GGUF scheme the weight must become
REPACKS = {(4, True): "gguf_q4_0", (4, False): "gguf_q4_1", (8, True): "gguf_q8_0"}
GGUF_TYPES = {
    "gguf_q4_0": GGMLQuantizationType.Q4_0,
    "gguf_q4_1": GGMLQuantizationType.Q4_1,
    "gguf_q8_0": GGMLQuantizationType.Q8_0,
}


def fresh_seed() -> int:
    """A seed drawn anew each run (reported on failure), so that runs cover different inputs."""
    return int(np.random.default_rng().integers(0, 2**31 - 1))


def random_grouped(
    gen: torch.Generator,
    bits: int,
    symmetric: bool,
    group_size: int,
    out_features: int = OUT_FEATURES,
    in_features: int = IN_FEATURES,
    perm: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Random codes, scales and zero points with outputs of order one for unit-variance inputs.

    Scales have 7 significant bits, so that ``-zero * scale`` of a 4-bit zero point (4 bits) is exact in
    fp16 and the asymmetric weight can take the Q4_1 path.
    """
    top = 2**bits - 1
    groups = in_features // group_size
    codes = torch.randint(0, top + 1, (out_features, in_features), generator=gen)
    # (code - zero) has a spread of about top / sqrt(12); aim the weight at in_features**-0.5
    exponent = round(float(np.log2(in_features**-0.5 / (top / 12**0.5) / 96)))
    scales = torch.randint(64, 128, (out_features, groups), generator=gen).float() * 2.0**exponent
    if symmetric:
        zeros = torch.full((out_features, groups), float(2 ** (bits - 1)))
    else:
        zeros = torch.randint(0, top + 1, (out_features, groups), generator=gen).float()
    return grouped_int_weight(codes, scales, zeros, group_size, bits, perm)


@pytest.fixture(scope="module")
def native() -> Iterator[NativeKernels | None]:
    """The C kernels where they build here, else None (their cases are then skipped)."""
    loaded = load_native()
    if loaded.lib is None:
        yield None
        return
    kernels = NativeKernels(loaded.lib, threads=2)
    yield kernels
    kernels.close()


def make_backend(kernels: str, native: NativeKernels | None, dense_copy: bool) -> CpuGemmBackend:
    """torch's packed kernels or the plugin's C kernels (skipped where they are unavailable)."""
    if kernels == "native":
        if native is None:
            pytest.skip("the CPU C kernels are unavailable here")
        return CpuGemmBackend(dense_copy=dense_copy, native=native)
    return CpuGemmBackend(dense_copy=dense_copy)


def check_linear(
    gemm: CpuGemmBackend, prepared: object, weight: QuantizedWeight, seed: int, what: str
) -> None:
    """``gemm.linear`` in bf16, with and without bias, within the conformance suite's quantized tolerance."""
    gen = torch.Generator().manual_seed(seed + 1)
    dense = weight.dequantize().double()
    tol = get_tolerance(torch.bfloat16, quantized=True)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, weight.shape[1], generator=gen).to(torch.bfloat16)
        bias = torch.randn(weight.shape[0], generator=gen).to(torch.bfloat16)
        expected = x.double() @ dense.T
        for b in (None, bias):
            out = gemm.linear(x, prepared, b)
            assert out.dtype == torch.bfloat16
            ref = expected if b is None else expected + b.double()
            label = f"{what} rows={rows} bias={b is not None} seed={seed}"
            problem = compare(out, ref, tol, label)
            assert not problem, problem
        # a 3-D batch goes through the same kernels
        out = gemm.linear(x.reshape(1, rows, -1), prepared)
        problem = compare(out.reshape(rows, -1), expected, tol, f"{what} rows={rows} 3-D seed={seed}")
        assert not problem, problem


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("dense_copy", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize(("bits", "symmetric"), list(REPACKS))
def test_repacked_weight_runs_packed_and_matches_float64(
    native: NativeKernels | None, kernels: str, dense_copy: bool, group_size: int, bits: int, symmetric: bool
) -> None:
    seed = fresh_seed()
    weight = random_grouped(torch.Generator().manual_seed(seed), bits, symmetric, group_size)
    gemm = make_backend(kernels, native, dense_copy)
    prepared = gemm.prepare_weight(weight, torch.bfloat16)
    # a dense tensor here would mean the weight was silently dequantized
    assert isinstance(prepared, PackedWeight), f"seed={seed}: got {type(prepared).__name__}"
    assert (prepared.tiled is not None) == (kernels == "native")
    assert (prepared.dense is not None) == dense_copy
    assert (prepared.out_features, prepared.in_features) == tuple(weight.shape)
    check_linear(
        gemm, prepared, weight, seed, f"{REPACKS[bits, symmetric]} from {weight.scheme} g{group_size}"
    )


@pytest.mark.parametrize("group_size", [32, 64, 256])
@pytest.mark.parametrize(("bits", "symmetric"), list(REPACKS))
def test_repacked_bytes_are_gguf_blocks_of_the_same_matrix(
    group_size: int, bits: int, symmetric: bool
) -> None:
    """gguf's own dequantization of the repacked bytes is the grouped weight, bit for bit."""
    seed = fresh_seed()
    weight = random_grouped(torch.Generator().manual_seed(seed), bits, symmetric, group_size)
    repacked = repack_grouped_as_gguf(weight)
    assert repacked is not None
    assert repacked.scheme == REPACKS[bits, symmetric] and repacked.shape == weight.shape
    decoded = quants.dequantize(repacked.data.numpy(), GGUF_TYPES[repacked.scheme])
    decoded = torch.from_numpy(np.ascontiguousarray(decoded)).reshape(weight.shape)
    assert torch.equal(decoded, weight.dequantize()), f"seed={seed}"


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_weight_is_dequantized_and_matches_float64(
    native: NativeKernels | None, kernels: str, bits: int
) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(IN_FEATURES, generator=gen)
    weight = random_grouped(gen, bits, True, 32, perm=perm)
    gemm = make_backend(kernels, native, dense_copy=True)
    prepared = gemm.prepare_weight(weight, torch.bfloat16)
    assert isinstance(prepared, torch.Tensor) and prepared.dtype == torch.bfloat16
    check_linear(gemm, prepared, weight, seed, f"act-order {weight.scheme}")


def test_sdk_test_weights_fall_back_and_match_float64() -> None:
    """The conformance suite's weights (asymmetric, act-order) take the dequantizing path."""
    seed = fresh_seed()
    gemm = CpuGemmBackend()
    for scheme in ("int4_grouped", "int8_grouped"):
        weight = make_quantized_weight(scheme, OUT_FEATURES, IN_FEATURES, seed=seed)
        prepared = gemm.prepare_weight(weight, torch.bfloat16)
        assert isinstance(prepared, torch.Tensor)
        check_linear(gemm, prepared, weight, seed, f"SDK {scheme}")


def _with(weight: QuantizedWeight, **extra: object) -> QuantizedWeight:
    """``weight`` with some ``extra`` fields replaced (sharing its codes)."""
    return QuantizedWeight(
        weight.scheme, weight.data, weight.shape, weight.dequantize, {**weight.extra, **extra}
    )


def test_weights_the_gguf_blocks_cannot_hold_are_refused() -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    int4 = random_grouped(gen, 4, False, 32)
    int8 = random_grouped(gen, 8, True, 32)
    assert repack_grouped_as_gguf(int4) is not None and repack_grouped_as_gguf(int8) is not None
    small_groups = random_grouped(gen, 4, True, 16)
    # a scale that fp16 rounds; and an fp16-exact scale whose minimum does not fit (3 * 2047 needs 13 bits)
    inexact_scale = _with(int4, scales=int4.extra["scales"] * (1 + 2.0**-15))
    zeros, scales = int4.extra["zeros"], int4.extra["scales"]
    inexact_minimum = _with(
        int4, zeros=torch.full_like(zeros, 3.0), scales=torch.full_like(scales, 2047 * 2.0**-20)
    )
    overflow = _with(int4, scales=torch.full_like(int4.extra["scales"], float("inf")))
    asymmetric_int8 = _with(int8, zeros=torch.full_like(int8.extra["zeros"], 127.0))
    for name, weight in {
        "act-order": _with(int4, perm=torch.randperm(IN_FEATURES, generator=gen)),
        "group 16": small_groups,
        "inexact scale": inexact_scale,
        "inexact minimum": inexact_minimum,
        "infinite scale": overflow,
        "asymmetric int8": asymmetric_int8,
    }.items():
        assert repack_grouped_as_gguf(weight) is None, f"{name} (seed={seed})"
    for name, weight in {"group 16": small_groups, "asymmetric int8": asymmetric_int8}.items():
        prepared = CpuGemmBackend(prepack=False).prepare_weight(weight, torch.bfloat16)
        assert isinstance(prepared, torch.Tensor), name
        assert torch.equal(prepared, weight.dequantize().to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="not a grouped-int weight"):
        repack_grouped_as_gguf(make_quantized_weight("gguf_q4_0", 32, 64))


@pytest.mark.parametrize("perm", [False, True])
@pytest.mark.parametrize(("bits", "symmetric"), list(REPACKS))
def test_float32_model_dequantizes_exactly(bits: int, symmetric: bool, perm: bool) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(IN_FEATURES, generator=gen) if perm else None
    weight = random_grouped(gen, bits, symmetric, 64, perm=order)
    gemm = CpuGemmBackend()
    prepared = gemm.prepare_weight(weight, torch.float32)
    dense = weight.dequantize()
    assert isinstance(prepared, torch.Tensor) and prepared.dtype == torch.float32
    assert torch.equal(prepared, dense), f"seed={seed}"
    x = torch.randn(5, IN_FEATURES, generator=gen)
    out = gemm.linear(x, prepared)
    assert torch.equal(out, torch.nn.functional.linear(x, dense)), f"seed={seed}"
    problem = compare(
        out, x.double() @ dense.double().T, get_tolerance(torch.float32), f"float32 seed={seed}"
    )
    assert not problem, problem


def test_backend_and_platform_claim_the_grouped_schemes() -> None:
    from engine_plugin_cpu.platform import CpuPlatform

    claimed = set(CpuPlatform().capabilities().quant_schemes)
    assert {"int4_grouped", "int8_grouped"} <= claimed
    assert {"int4_grouped", "int8_grouped"} <= CpuGemmBackend().supported_quant_schemes
    assert {"int4_grouped", "int8_grouped"} <= CpuGemmBackend.supported_quant_schemes

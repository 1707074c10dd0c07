"""GGUF Q5_0, IQ4_NL and IQ4_XS on the CPU: repacked into Q8_0 bytes at load (Q5_0's ``d * (q - 16)`` and IQ4_NL's
``d * table[q]`` are Q8_0's ``d * q8`` exactly; IQ4_XS's group scales round to fp16), so that the packed Q8_0
kernels run them instead of a dequantized copy; checked against gguf's dequantizers and through the GEMM backend
against the float64 product, on the C kernels and on torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine_plugin_cpu.gemm import CpuGemmBackend, PackedWeight
from engine_plugin_cpu.native_build import load_native
from engine_plugin_cpu.native_kernels import NativeKernels
from engine_plugin_cpu.quant_pack import codes_as_q8_0
from engine_plugin_sdk.quant import make_quantized_weight
from engine_plugin_sdk.tolerances import compare, get_tolerance


def fresh_seed() -> int:
    return int(torch.randint(0, 1 << 30, ()))


def _q8_0_values(data: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    dense = quants.dequantize(data.numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).reshape(shape)


def test_q5_0_becomes_q8_0_bit_for_bit() -> None:
    weight = make_quantized_weight("gguf_q5_0", 24, 512, seed=fresh_seed())
    repacked = codes_as_q8_0(weight.data, "gguf_q5_0", (24, 512))
    assert repacked.dtype == torch.uint8 and tuple(repacked.shape) == (24, 512 // 32 * 34)
    assert torch.equal(_q8_0_values(repacked, (24, 512)), weight.dequantize())


def test_the_ends_of_the_five_bit_range() -> None:
    """Every code 0 (q8 -16) or every code 31 (q8 15: all four qh bytes set), the largest fp16 scale."""
    for fill, qh in ((0x00, 0x00), (0xFF, 0xFF)):
        weight = make_quantized_weight("gguf_q5_0", 2, 64, seed=fresh_seed())
        blocks = weight.data.reshape(-1, 22)
        blocks[:, 0:2] = torch.tensor([60000.0], dtype=torch.float16).view(torch.uint8)
        blocks[:, 2:6] = qh
        blocks[:, 6:22] = fill
        assert torch.equal(_q8_0_values(codes_as_q8_0(weight.data, "gguf_q5_0", (2, 64)), (2, 64)), weight.dequantize())


def test_iq4_values_become_q8_0_bytes() -> None:
    """IQ4_NL bit for bit; IQ4_XS within its group scales' fp16 rounding (2^-11 of each group's largest value)."""
    nl = make_quantized_weight("gguf_iq4_nl", 24, 512, seed=fresh_seed())
    assert torch.equal(_q8_0_values(codes_as_q8_0(nl.data, "gguf_iq4_nl", (24, 512)), (24, 512)), nl.dequantize())
    xs = make_quantized_weight("gguf_iq4_xs", 24, 512, seed=fresh_seed())
    got, want = _q8_0_values(codes_as_q8_0(xs.data, "gguf_iq4_xs", (24, 512)), (24, 512)), xs.dequantize()
    group_max = want.reshape(24, -1, 32).abs().amax(dim=-1, keepdim=True)
    assert ((got - want).reshape(24, -1, 32).abs() <= group_max * 2.0**-11).all()


@pytest.mark.parametrize("scheme", ["gguf_q5_0", "gguf_iq4_nl", "gguf_iq4_xs"])
@pytest.mark.parametrize("native", [True, False], ids=["c-kernels", "torch"])
def test_the_backend_keeps_them_packed(native: bool, scheme: str) -> None:
    kernels = None
    if native:
        loaded = load_native()
        if loaded.lib is None:
            pytest.skip(f"no C kernels here: {loaded.reason}")
        kernels = NativeKernels(loaded.lib)
    gemm = CpuGemmBackend(native=kernels)
    assert scheme in gemm.supported_quant_schemes
    seed = fresh_seed()
    weight = make_quantized_weight(scheme, 100, 256, seed=seed)
    prepared = gemm.prepare_weight(weight, torch.bfloat16)
    assert isinstance(prepared, PackedWeight), f"seed {seed}: {scheme} was not kept packed"
    gen = torch.Generator().manual_seed(seed)
    for rows in (1, 3):
        x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
        want = x.double() @ weight.dequantize().double().T
        problem = compare(gemm.linear(x, prepared), want, get_tolerance(torch.bfloat16, quantized=True), f"{scheme} seed {seed}")
        assert not problem, problem
    # float32 weights keep the exact dequantized path
    assert isinstance(gemm.prepare_weight(weight, torch.float32), torch.Tensor)

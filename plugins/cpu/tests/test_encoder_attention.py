"""The AMX encoder attention (``csrc/encoder_attention.c``) against a float64 softmax; skipped where the CPU
has no AMX-BF16 tiles (the attention backend's use of it: ``test_attention.py``)."""

from __future__ import annotations

import pytest
import torch
from amx_test_kernels import amx_kernels

from engine_plugin_cpu.native_build import AMX_CPU_FLAGS, amx_usable
from engine_plugin_cpu.native_kernels import NativeKernels

#: bf16 inputs, probabilities and outputs: a few bf16 steps of an output of magnitude ~1
TOL = {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture(scope="module")
def tiles() -> NativeKernels:
    yield from amx_kernels()


def _fused_qkv(tokens: int, heads: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q / k / v as strided views of one fused projection's rows, like a model's."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(torch.bfloat16)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    return q, k, v


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float
) -> torch.Tensor:
    out, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lens:
        qq, kk, vv = (t[start : start + n].double().transpose(0, 1) for t in (q, k, v))
        kk, vv = kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0)
        out.append((torch.softmax(qq @ kk.transpose(1, 2) * scale, -1) @ vv).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "dim"),
    [
        ([128, 128, 128], 12, 12, 32),  # bge-small's shape: whole tiles only
        ([1, 5, 17, 31, 33, 100], 4, 2, 64),  # partial tiles and query blocks, grouped heads
        ([7], 2, 1, 128),  # one short prompt, a wide head
        ([300, 64, 250], 3, 3, 96),  # an odd number of key blocks, three 32-dim chunks
    ],
)
def test_encoder_attention_against_float64(
    tiles: NativeKernels, lens: list[int], heads: int, kv_heads: int, dim: int
) -> None:
    q, k, v = _fused_qkv(sum(lens), heads, kv_heads, dim, seed=len(lens) + dim)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    scale = dim**-0.5
    got = tiles.encoder_attention(q, k, v, starts, max(lens), scale)
    expected = _reference(q, k, v, lens, scale)
    torch.testing.assert_close(got.double(), expected, **TOL)
    # the same rounding as torch's own bf16 attention, not just within tolerance: mean error of that order
    assert (got.double() - expected).abs().mean() < 2e-3
    assert torch.equal(tiles.encoder_attention(q, k, v, starts, max(lens), scale, threads=1), got)


def test_encoder_attention_refuses_head_dims_off_its_tiles(tiles: NativeKernels) -> None:
    q, k, v = _fused_qkv(8, 2, 2, 48, seed=1)
    with pytest.raises(ValueError, match="head dimension in 32s"):
        tiles.encoder_attention(q, k, v, torch.tensor([0, 8]), 8, 0.1)


def test_amx_env_switch_and_flags() -> None:
    assert not amx_usable(AMX_CPU_FLAGS, {"ENGINE_CPU_AMX": "0"})
    assert amx_usable(AMX_CPU_FLAGS | {"avx512f"}, {})
    assert not amx_usable(frozenset({"amx_tile"}), {})

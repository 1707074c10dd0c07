"""The AMX encoder attention (``csrc/encoder_attention.c``) against a float64 softmax; skipped where the CPU
has no AMX-BF16 tiles (the attention backend's use of it: ``test_attention.py``)."""

from __future__ import annotations

import pytest
import torch
from amx_test_kernels import amx_kernels

from engine_plugin_cpu.native_build import AMX_CPU_FLAGS, amx_usable
from engine_plugin_cpu.native_kernels import NativeKernels, torch_omp_team

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


def test_encoder_attention_refuses_head_dims_off_its_tiles_and_prompts_past_max_len(tiles: NativeKernels) -> None:
    q, k, v = _fused_qkv(8, 2, 2, 48, seed=1)
    with pytest.raises(ValueError, match="head dimension in 32s"):
        tiles.encoder_attention(q, k, v, torch.tensor([0, 8]), 8, 0.1)
    q, k, v = _fused_qkv(40, 2, 2, 32, seed=2)
    with pytest.raises(ValueError, match="longer than max_len=16"):  # its scratch would overflow
        tiles.encoder_attention(q, k, v, torch.tensor([0, 40]), 16, 0.1)


def test_amx_env_switch_and_flags() -> None:
    assert not amx_usable(AMX_CPU_FLAGS, {"ENGINE_CPU_AMX": "0"})
    assert amx_usable(AMX_CPU_FLAGS | {"avx512f"}, {})
    assert not amx_usable(frozenset({"amx_tile"}), {})


def test_torch_threads_and_the_pool_give_the_same_result(tiles: NativeKernels) -> None:
    """The kernel runs as a region of torch's OpenMP team where one is found (its workers are the ones a
    torch op left spinning), else on the plugin's own pool: the tasks are the same either way."""
    pool = amx_kernels(torch_threads=False)
    own = next(pool)
    assert own.team is None
    lens = [40, 128, 3]
    q, k, v = _fused_qkv(sum(lens), 6, 3, 64, seed=9)
    starts = torch.tensor([0, 40, 168, 171], dtype=torch.int64)
    torch.nn.functional.linear(torch.randn(512, 512), torch.randn(512, 512))  # torch's team is now awake
    assert torch.equal(
        tiles.encoder_attention(q, k, v, starts, 128, 0.125),
        own.encoder_attention(q, k, v, starts, 128, 0.125),
    )
    pool.close()


def test_torch_omp_team_is_found_only_when_unambiguous(tmp_path) -> None:
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch does not run its ops on OpenMP")
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libfoo.so\n")
    assert torch_omp_team(str(maps)) is None
    maps.write_text(
        "7f00-7f01 r-xp 0 08:01 1 /opt/a/libgomp.so.1\n7f02-7f03 r-xp 0 08:01 2 /opt/b/libomp.so\n"
    )
    assert torch_omp_team(str(maps)) is None  # two runtimes, neither torch's: which one torch uses is unknown
    assert torch_omp_team(str(tmp_path / "absent")) is None
    found = torch_omp_team()
    assert found is not None and found.parallel and found.thread_num and found.num_threads

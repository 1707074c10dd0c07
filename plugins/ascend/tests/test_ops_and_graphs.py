"""The fused-op glue (argument shapes and dtypes handed to the kernels) and the NPU-graph bucket policy."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine_plugin_ascend import reference_kernels
from engine_plugin_ascend.graph import AscendGraphCapture, bucket_for, decode_buckets, normalize_buckets
from engine_plugin_ascend.ops import AscendOps
from engine_plugin_sdk.reference_ops import (
    make_cos_sin_cache,
    ref_fused_add_rms_norm,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
)
from engine_plugin_sdk.tolerances import compare, get_tolerance


class Recorder:
    """Records each kernel call and runs the reference substitute."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str) -> Any:
        real = getattr(reference_kernels, name)

        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            return real(*args, **kwargs)

        return record


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float16, what
    problem = compare(got, want, get_tolerance(torch.float16), what)
    assert not problem, problem


def test_norms_cast_the_weight_to_the_activation_dtype() -> None:
    gen = torch.Generator().manual_seed(1)
    kernels = Recorder()
    ops = AscendOps(kernels)
    x, res, w = rand(gen, 5, 96), rand(gen, 5, 96), rand(gen, 96, dtype=torch.float32)
    check(ops.rms_norm(x, w, 1e-6), ref_rms_norm(x, w.half(), 1e-6), "rms_norm")
    out, summed = ops.fused_add_rms_norm(x, res, w, 1e-6)
    want_out, want_sum = ref_fused_add_rms_norm(x, res, w.half(), 1e-6)
    check(out, want_out, "fused_add_rms_norm")
    check(summed, want_sum, "fused_add_rms_norm sum")
    assert [c[0] for c in kernels.calls] == ["rms_norm", "add_rms_norm"]
    assert all(c[1][-2].dtype == torch.float16 for c in kernels.calls)  # gamma went in as fp16


def test_rotary_expands_cos_sin_once_per_step() -> None:
    gen = torch.Generator().manual_seed(2)
    kernels = Recorder()
    ops = AscendOps(kernels)
    cache = make_cos_sin_cache(64, 128)
    positions = torch.randint(0, 64, (7,), generator=gen)
    q, k = rand(gen, 7, 8, 128), rand(gen, 7, 2, 128)
    got_q, got_k = ops.rotary_embedding(positions, q, k, cache)
    want_q, want_k = ref_rotary_embedding(positions, q, k, cache)
    check(got_q, want_q, "rotary query")
    check(got_k, want_k, "rotary key")
    (_, (x, r1, r2)), (_, (xk, r1k, _)) = kernels.calls
    assert x.shape == (1, 7, 8, 128) and xk.shape == (1, 7, 2, 128)
    assert r1.shape == r2.shape == (1, 7, 1, 128) and r1.dtype == torch.float16 and r1k is r1
    ops.rotary_embedding(positions, q, k, cache)  # the next layer, same positions
    assert kernels.calls[2][1][1] is r1
    ops.rotary_embedding(positions.clone(), q, k, cache)  # a new step
    assert kernels.calls[4][1][1] is not r1
    with pytest.raises(ValueError, match="whole heads"):
        ops.rotary_embedding(positions, q, k, make_cos_sin_cache(64, 64))


def test_silu_and_mul_is_swiglu_on_the_last_dim() -> None:
    gen = torch.Generator().manual_seed(3)
    x = rand(gen, 4, 2 * 80)
    check(AscendOps(reference_kernels).silu_and_mul(x), ref_silu_and_mul(x), "silu_and_mul")


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, [1]),
        (6, [1, 2, 4, 6]),
        (8, [1, 2, 4, 8]),
        (40, [1, 2, 4, 8, 16, 32, 40]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
    ],
)
def test_decode_buckets(max_num_seqs: int, expected: list[int]) -> None:
    assert decode_buckets(max_num_seqs) == expected


def test_bucket_choice_and_validation() -> None:
    buckets = decode_buckets(40)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 9, 17, 33, 40)] == [1, 4, 8, 16, 32, 40, 40]
    assert bucket_for(41, buckets) is None
    assert normalize_buckets([8, 1, 8, 4]) == [1, 4, 8]
    with pytest.raises(ValueError, match="positive ints"):
        normalize_buckets([1, 0, True])
    with pytest.raises(ValueError, match="positive"):
        decode_buckets(0)


class CountingKernels:
    """Counts captures and replays of the reference graph emulation."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replays = 0

    def capture_graph(self, fn: Any, inputs: Any) -> Any:
        self.captured.append(inputs[0].shape[0])
        return reference_kernels.capture_graph(fn, inputs)

    def replay_graph(self, graph: Any) -> None:
        self.replays += 1
        reference_kernels.replay_graph(graph)


def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) + 1.0


def test_graph_replay_reads_fresh_inputs_and_falls_back_to_eager() -> None:
    gen = torch.Generator().manual_seed(4)
    kernels = CountingKernels()
    capture = AscendGraphCapture(kernels)
    with pytest.raises(RuntimeError, match="before capture"):
        capture.run(1, torch.zeros(1, 8))
    w = torch.randn(8, 8, generator=gen)
    capture.capture(step, [4, 1, 2, 4], lambda n: (torch.randn(n, 8, generator=gen), w))
    assert kernels.captured == [1, 2, 4] and capture.captured_batch_sizes() == [1, 2, 4]
    first = None
    for _ in range(2):
        x = torch.randn(4, 8, generator=gen)
        out = capture.run(4, x, w)
        torch.testing.assert_close(out, step(x, w))
        first = out if first is None else first
    assert out is first, "a replay writes the captured output tensor"
    x3 = torch.randn(3, 8, generator=gen)
    torch.testing.assert_close(capture.run(3, x3, w), step(x3, w))
    assert kernels.replays == 2
    with pytest.raises(ValueError, match="shape"):
        capture.run(2, torch.randn(3, 8), w)
    with pytest.raises(ValueError, match="captured with 2 inputs"):
        capture.run(2, torch.randn(2, 8))

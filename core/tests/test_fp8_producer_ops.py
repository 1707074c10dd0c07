"""FP8 producer ops and the greedy pick: the reference ops, and the model handing W8A8 GEMMs their
inputs already quantized when the GEMM backend asks (``GemmBackend.row_quantized_input``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from engine.interfaces.gemm import GemmBackend, RowQuantizedActivations
from engine.interfaces.ops import (
    fused_add_rms_norm,
    fused_add_rms_norm_fp8,
    greedy_pick,
    quantize_rows,
    reference_ops,
    silu_and_mul,
    silu_and_mul_fp8,
)
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler
from engine_plugin_cpu.platform import CpuPlatform

FP8 = torch.float8_e4m3fn


def _dequantized(rows: RowQuantizedActivations) -> torch.Tensor:
    return rows.data.double() * rows.scale.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_producers_quantize_the_unfused_results(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(7, 64, generator=gen) * 3).to(dtype), torch.randn(7, 64, generator=gen).to(dtype)
    weight = torch.randn(64, generator=gen).to(dtype)
    rows, summed = fused_add_rms_norm_fp8(x, residual, weight, 1e-5, FP8)
    normed, want_sum = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_sum)
    assert rows.data.dtype == FP8 and rows.scale.shape == (7, 1) and rows.dtype == dtype
    assert torch.equal(rows.data.view(torch.uint8), quantize_rows(normed, FP8).data.view(torch.uint8))
    # every row's largest value sits at the top of e4m3, the rest within half a step (1/16) of the value
    assert torch.equal(rows.data.float().abs().amax(dim=1), torch.full((7,), 448.0))
    ref = normed.double()
    assert ((_dequantized(rows) - ref).abs() <= ref.abs() / 16 + rows.scale.double() * 2.0**-9).all()

    gate_up = torch.randn(5, 96, generator=gen).to(dtype)
    act = silu_and_mul_fp8(gate_up, FP8)
    assert act.data.shape == (5, 48) and act.dtype == dtype
    assert torch.equal(act.data.view(torch.uint8), quantize_rows(silu_and_mul(gate_up), FP8).data.view(torch.uint8))
    # the other e4m3 flavour has its own top (240)
    assert quantize_rows(gate_up, torch.float8_e4m3fnuz).data.float().abs().max() == 240.0


def test_greedy_pick_skips_padding_and_takes_the_first_maximum() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 40, generator=gen) * 3
    logits[:, 30:] = 50.0  # padding columns past the vocabulary
    logits[2, 7] = logits[2, 11] = 20.0  # a tie: the first one wins
    ids, logprobs = greedy_pick(logits, 30)
    raw = torch.log_softmax(logits[:, :30].double(), dim=-1)
    assert ids.dtype == torch.int64 and ids.tolist() == raw.argmax(dim=-1).tolist() and ids[2] == 7
    torch.testing.assert_close(logprobs.double(), raw.gather(1, ids[:, None]).squeeze(1), rtol=1e-6, atol=1e-6)

    calls = []

    def spy(lg: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(vocab)
        return greedy_pick(lg, vocab)

    sampler = Sampler([2], 30, greedy_pick=spy)
    assert sampler.greedy_on_device(logits)[0].tolist() == ids.tolist() and calls == [30]


@dataclass
class _W8A8:
    """A weight whose products simulate W8A8: activations rounded to one FP8 term per row."""

    weight: torch.Tensor


class _SimulatedW8A8Gemm(GemmBackend):
    """The CPU GEMM with W8A8 activations: quantized by the producing op when ``ask`` (the fused path),
    else by the product itself (what a GEMM without fusion does). Both must give the same numbers."""

    def __init__(self, inner: GemmBackend, ask: bool) -> None:
        self.inner, self.ask, self.prequantized_calls = inner, ask, 0

    def prepare_weight(self, weight: Any, dtype: Any) -> Any:
        return _W8A8(self.inner.prepare_weight(weight, dtype))

    def row_quantized_input(self, weight: Any) -> Any | None:
        return FP8 if self.ask and isinstance(weight, _W8A8) else None

    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> Any:
        if isinstance(x, RowQuantizedActivations):
            assert self.ask, "FP8 rows reached a GEMM that did not ask for them"
            self.prequantized_calls += 1
            rows = x
        else:
            rows = quantize_rows(x, FP8)
        plain = (rows.data.float() * rows.scale).to(rows.dtype)
        return self.inner.linear(plain, weight.weight, bias)


@pytest.fixture
def w8a8_cpu(monkeypatch: pytest.MonkeyPatch) -> list[_SimulatedW8A8Gemm]:
    made: list[_SimulatedW8A8Gemm] = []
    original = CpuPlatform.make_gemm_backend

    def make(self: CpuPlatform, ask: bool) -> GemmBackend:
        made.append(_SimulatedW8A8Gemm(original(self), ask))
        return made[-1]

    monkeypatch.setattr(CpuPlatform, "make_gemm_backend", lambda self: make(self, ask=len(made) == 0))
    return made


def test_model_hands_w8a8_gemms_prequantized_inputs(tiny_llama_dir: str, w8a8_cpu: list) -> None:
    options = {"model": tiny_llama_dir, "device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": 8 << 20}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [[1, 5, 9, 33, 7], [1, 60, 61, 62, 63, 64, 65, 66, 67]]
    fused = LLM(**options).generate(prompts, params, use_tqdm=False)
    unfused = LLM(**options).generate(prompts, params, use_tqdm=False)
    asking, plain = w8a8_cpu
    layers = 2
    # per layer from the second on: the input norm (qkv); in every layer the post norm (gate_up) and the
    # SwiGLU product (down); o_proj and the first layer's qkv still quantize inside the product
    assert asking.prequantized_calls > 0 and asking.prequantized_calls % (3 * layers - 1) == 0
    assert plain.prequantized_calls == 0
    for a, b in zip(fused, unfused, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob


def test_reference_table_lists_every_op() -> None:
    table = reference_ops()
    assert table.greedy_pick is greedy_pick and table.silu_and_mul_fp8 is silu_and_mul_fp8

"""A tiny GPTQ W4A16 Llama (groups of 128; symmetric with act-order, and zero points without) on device ``cuda`` in Triton's
interpreter, in float16: several sequences decode together, so their steps' products of 2-8 rows take the
fragment kernel (:mod:`engine_plugin_sdk.gpu.triton_kernels.grouped_int4_fragment_kernels`; gate/up with its
SwiGLU in one launch), and the greedy tokens and their log-probabilities match the same checkpoint dequantized
at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prequantized_checkpoints import write_gptq

from engine import LLM, SamplingParams
from engine_plugin_nvidia.platform import INTERPRET_ENV
from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_launchers as launchers
from engine_plugin_sdk.testing import build_tiny_llama

PROMPTS = [[1, 5, 9, 33, 7], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 100], [1, 7, 8]]


def _packed(weight: object) -> bool:
    """A packed weight, or row blocks that are all packed (act-order: q, k, v each keep their permutation)."""
    parts = getattr(weight, "parts", None)
    return all(map(_packed, parts)) if parts is not None else isinstance(weight, GroupedIntWeight)


def _decode(path: str, quantization: str) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens and their log-probabilities of each prompt, and how many projections stayed packed."""
    llm = LLM(model=path, device="cuda", dtype="float16", quantization=quantization, block_size=16,
              max_num_seqs=4, max_model_len=64, kv_cache_memory_bytes=8 << 20)  # fmt: skip
    layer = llm.llm_engine.model.layers[0]
    packed = sum(_packed(getattr(layer, f)) for f in ("qkv", "o_proj", "gate_up", "down"))
    # the prompts' step (19 rows: the GEMM), then a decode step of the four sequences (the fragment kernel)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
    tokens = [list(o.token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.logprobs, o.token_ids, strict=True)] for o in outs]
    return tokens, logprobs, packed


@pytest.mark.slow  # two engines in the interpreter
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric-act-order", "zero-points"])
def test_gptq_sequences_decode_together_on_the_fragment_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, symmetric: bool
) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: device cuda is not the interpreter here")
    monkeypatch.setenv(INTERPRET_ENV, "1")
    plain = tmp_path / "plain"
    build_tiny_llama(plain, head_dim=64, seed=5, num_layers=1)  # hidden 256, MLP 256: two chunks of 128 columns a product
    # act-order gives each projection its own column order (gate and up as two blocks of rows); without it
    # the gate/up product is one weight, and takes its SwiGLU in the same launch
    path, _ = write_gptq(str(plain), str(tmp_path / "gptq"), str(tmp_path / "reference"), bits=4, group=128,
                         symmetric=symmetric, act_order=symmetric)  # fmt: skip
    rows: list[int] = []
    gated: list[int] = []

    def counted(rows_in, *args, _real=launchers.fragment_linear):
        (gated if len(args) > 4 else rows).append(rows_in.shape[0])
        return _real(rows_in, *args)

    monkeypatch.setattr(launchers, "fragment_linear", counted)
    tokens, logprobs, packed = _decode(path, "auto")
    assert packed == 4 and rows and max(rows) <= 8 and min(rows) >= 2
    assert 4 in rows  # the four sequences' decode steps
    if symmetric:
        assert not gated
    else:
        assert 4 in gated and len(gated) * 3 == len(rows)
    monkeypatch.setattr(launchers, "fragment_linear", None)  # the dequantized run must not reach it
    want_tokens, want_logprobs, dense = _decode(path, "none")
    assert dense == 0
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-2, rtol=0)

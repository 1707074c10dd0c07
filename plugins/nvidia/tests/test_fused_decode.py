"""A Qwen3 through the fused decode path (per-head q/k norms and rotary inside the decode kernel) against
HF transformers, through the public ``LLM`` API in Triton's interpreter (on the GPU: the real kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine_plugin_nvidia.platform import INTERPRET_ENV
from engine_plugin_sdk.gpu.attention import TritonPagedAttentionBackend
from engine_plugin_sdk.testing import build_tiny_llama, hf_greedy

PROMPTS = [[1, 5, 9, 33, 7], [1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 3]]


@pytest.mark.slow
def test_qwen3_decode_normalises_heads_in_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRET_ENV, "1")
    hf = build_tiny_llama(tmp_path, head_dim=64, architecture="qwen3", num_layers=1)  # a second runs the same kernels
    fused_steps: list[int] = []
    original = TritonPagedAttentionBackend.forward_rotary

    def counting(self, query, key, value, kv_cache, metadata, rotary):  # noqa: ANN001, ANN202
        if rotary.head_norm is not None and metadata.is_pure_decode:
            fused_steps.append(metadata.num_seqs)
        return original(self, query, key, value, kv_cache, metadata, rotary)

    monkeypatch.setattr(TritonPagedAttentionBackend, "forward_rotary", counting)
    llm = LLM(model=str(tmp_path), device="cuda", dtype="float32", block_size=16, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert fused_steps, "decode steps should hand the head norms to the attention backend"
    for prompt, out in zip(PROMPTS, outs, strict=True):
        expected, _ = hf_greedy(hf, prompt)
        assert list(out.outputs[0].token_ids) == expected

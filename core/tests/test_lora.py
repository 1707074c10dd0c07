"""Multi-LoRA through the offline API: a batch mixing the base model and more adapters than device slots
equals HF with each adapter merged; the prefix cache never shares blocks across adapters; adapters load,
unload and fail cleanly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from dense_model_utils import hf_greedy
from lora_adapters import merged_hf

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.lora import LoRARequest
from engine_test_utils import assert_all_blocks_free

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away",
    "1, 2, 3,",
    "Paged attention stores the key value cache in fixed size blocks so that memory is not wasted",
]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir):
    # two slots and three adapters in host memory for four adapters: steps must swap adapters in and out
    llm = LLM(
        tiny_llama_dir, device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
        max_cpu_loras=3, max_num_seqs=8,
    )  # fmt: skip
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def references(tiny_llama_dir, tiny_llama_loras):
    models = {None: merged_hf(tiny_llama_dir, None)}
    models.update({name: merged_hf(tiny_llama_dir, path) for name, path in tiny_llama_loras.items()})
    return models


def _requests(loras: dict[str, str]) -> list[LoRARequest]:
    return [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(loras.items())]


def test_mixed_batch_matches_hf_merged(lora_llm, tiny_llama_loras, references):
    choices: list[LoRARequest | None] = [None, *_requests(tiny_llama_loras)]
    prompts = [p for p in PROMPTS for _ in choices]
    loras = [c for _ in PROMPTS for c in choices]
    outs = lora_llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    for out, lora in zip(outs, loras):
        expected = hf_greedy(references[None if lora is None else lora.lora_name], list(out.prompt_token_ids), 8)
        assert list(out.outputs[0].token_ids) == expected, lora
    # the adapters differ from the base model and from each other
    firsts = {tuple(o.outputs[0].token_ids) for o in outs[: len(choices)]}
    assert len(firsts) == len(choices)
    manager = lora_llm.llm_engine.loras.manager
    assert manager.num_loads > len(choices) - 1  # the host cache (3) is smaller than the adapters (5)
    assert_all_blocks_free(lora_llm)


def test_steps_never_exceed_max_loras(lora_llm, tiny_llama_loras):
    manager = lora_llm.llm_engine.loras.manager
    seen: list[int] = []
    activate = manager.activate

    def spy(ids):
        seen.append(len(ids))
        return activate(ids)

    manager.activate = spy
    try:
        requests = _requests(tiny_llama_loras)
        lora_llm.generate(PROMPTS * 2, GREEDY, lora_request=requests[:4] * 2, use_tqdm=False)
    finally:
        del manager.activate
    assert seen and max(seen) <= 2


def test_prefix_cache_is_per_adapter(lora_llm, tiny_llama_loras, references):
    # a prompt of several full blocks, cached under the base model first
    prompt = " ".join(["Paged attention stores the key value cache in fixed size blocks."] * 6)
    base = lora_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    lora = _requests(tiny_llama_loras)[2]
    under = lora_llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)[0]
    assert under.num_cached_tokens == 0
    assert list(under.outputs[0].token_ids) == hf_greedy(references[lora.lora_name], list(under.prompt_token_ids), 8)
    again = lora_llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16  # its own blocks are shared with itself
    assert again.outputs[0].token_ids == under.outputs[0].token_ids != base.outputs[0].token_ids


def test_add_list_remove(lora_llm, tiny_llama_loras, references):
    engine = lora_llm.llm_engine
    request = LoRARequest("extra", 50, tiny_llama_loras["mlp-r4"])
    assert engine.add_lora(request) is True
    assert engine.add_lora(request) is False
    assert request in engine.list_loras()
    with pytest.raises(InvalidRequestError, match="already used"):
        engine.add_lora(LoRARequest("other", 50, tiny_llama_loras["attn-r8"]))
    with pytest.raises(InvalidRequestError, match="already loaded"):
        engine.add_lora(LoRARequest("extra", 51, tiny_llama_loras["attn-r8"]))
    out = lora_llm.generate(PROMPTS[0], GREEDY, lora_request=request, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(references["mlp-r4"], list(out.prompt_token_ids), 8)
    assert engine.remove_lora(50) is True
    assert engine.remove_lora(50) is False
    assert request not in engine.list_loras()


def _broken(tmp_path, source: str, edit) -> str:
    folder = tmp_path / "broken"
    shutil.copytree(source, folder)
    edit(folder)
    return str(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: (f / "adapter_config.json").unlink(), "no adapter_config.json"),
        (lambda f: (f / "adapter_config.json").write_text("{not json"), "not valid JSON"),
        (lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x00" * 10), "cannot be read"),
        (lambda f: (f / "adapter_model.safetensors").unlink(), "neither adapter_model.safetensors"),
        (lambda f: _set_config(f, use_dora=True), "DoRA"),
        (lambda f: _set_config(f, r=32), "rank 16, its config says 32"),
    ],
)
def test_broken_adapter_is_one_line_error(lora_llm, tiny_llama_loras, tmp_path, edit, message):
    path = _broken(tmp_path, tiny_llama_loras["all-r16-rslora"], edit)
    before = lora_llm.llm_engine.list_loras()
    with pytest.raises(InvalidRequestError, match=message) as info:
        lora_llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("broken", 77, path), use_tqdm=False)
    assert "\n" not in str(info.value)
    assert lora_llm.llm_engine.list_loras() == before
    assert_all_blocks_free(lora_llm)


def _set_config(folder, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_rank_above_max_and_unknown_module(tiny_llama_dir, tiny_llama_loras, tmp_path):
    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8)
    try:
        with pytest.raises(InvalidRequestError, match="rank 16, above max_lora_rank=8"):
            llm.llm_engine.add_lora(LoRARequest("big", 1, tiny_llama_loras["all-r16-rslora"]))
        from safetensors.torch import load_file, save_file

        def rename_to_norm(folder) -> None:
            tensors = load_file(str(folder / "adapter_model.safetensors"))
            renamed = {k.replace("mlp.down_proj", "post_attention_layernorm"): v for k, v in tensors.items()}
            save_file(renamed, str(folder / "adapter_model.safetensors"))

        path = _broken(tmp_path, tiny_llama_loras["mlp-r4"], rename_to_norm)
        with pytest.raises(InvalidRequestError, match="post_attention_layernorm"):
            llm.llm_engine.add_lora(LoRARequest("emb", 2, path))
    finally:
        llm.shutdown()


def test_lora_request_needs_enable_lora(tiny_llama_dir, tiny_llama_loras):
    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32")
    try:
        with pytest.raises(InvalidRequestError, match="enable_lora=True"):
            llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("a", 1, tiny_llama_loras["mlp-r4"]), use_tqdm=False)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="need enable_lora=True"):
        LLM(tiny_llama_dir, device="cpu", max_loras=2)


def test_decode_graph_steps_carry_each_rows_slot(tiny_llama_dir, tiny_llama_loras, references):
    # decode steps replayed through the graph path (recorded eagerly here): each row's slot is a static
    # input padded with -1, planned from the device tensor alone
    from engine.decode_graphs import DecodeGraphs
    from engine.interfaces.graph_capture import EagerGraphCapture

    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", enable_lora=True, max_loras=3, max_num_seqs=6)
    try:
        runner = llm.llm_engine.runner
        runner.decode_graphs = DecodeGraphs(
            runner.model, runner.layer_caches, EagerGraphCapture(), 6, 256, 16, runner.device, lora_slots=3
        )
        runner.decode_graphs.capture()
        replays = []
        run = runner.decode_graphs.run
        runner.decode_graphs.run = lambda *a: replays.append(a[-1]) or run(*a)
        every = _requests(tiny_llama_loras)
        requests = [every[0], every[1], every[4]]  # attention, MLP, and the embeddings + lm_head
        loras = [None, *requests, requests[0]]
        outs = llm.generate(PROMPTS[:1] * 2 + PROMPTS[1:4], GREEDY, lora_request=loras, use_tqdm=False)
        for out, lora in zip(outs, loras):
            expected = hf_greedy(references[None if lora is None else lora.lora_name], list(out.prompt_token_ids), 8)
            assert list(out.outputs[0].token_ids) == expected, lora
        assert any(step is not None for step in replays)  # decodes went through the graph path with slots
    finally:
        llm.shutdown()


def test_beam_search_under_an_adapter(lora_llm, tiny_llama_loras, references):
    from engine.beam_search import BeamSearchParams

    lora = _requests(tiny_llama_loras)[0]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    out = lora_llm.beam_search(PROMPTS[1], params, lora_request=lora)[0]
    hf = references[lora.lora_name]
    ids = list(out.prompt_token_ids)
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), num_beams=3,
            max_new_tokens=6, min_new_tokens=6, do_sample=False, early_stopping=True, length_penalty=1.0, pad_token_id=0,
        )[0, len(ids) :].tolist()
    assert list(out.outputs[0].token_ids) == want
    base = lora_llm.beam_search(PROMPTS[1], params)[0]
    assert base.outputs[0].token_ids != out.outputs[0].token_ids
    assert_all_blocks_free(lora_llm)


def test_embeddings_under_adapters(lora_llm, tiny_llama_loras, references):
    # pooling requests under different adapters (and the base) share steps; each equals HF's merged model
    requests = _requests(tiny_llama_loras)
    loras = [None, requests[0], requests[2], requests[4]]
    outs = lora_llm.embed([PROMPTS[3]] * len(loras), lora_request=loras, use_tqdm=False)
    for out, lora in zip(outs, loras):
        hf = references[None if lora is None else lora.lora_name]
        with torch.no_grad():
            state = hf.model(torch.tensor([list(out.prompt_token_ids)])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(state, dim=-1)
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-4), lora
    assert_all_blocks_free(lora_llm)

"""LoRA adapters through the server: ``engine serve --enable-lora --lora-modules ...`` on the tiny Llama,
driven by the official ``openai`` client. Greedy tokens of the base model and of each adapter equal HF's
with the adapter merged; adapters are listed, selected by ``model``, loaded and unloaded at run time.
The async engine's adapter calls and the routes' absence without runtime updating run in process."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from dense_model_utils import hf_greedy
from fastapi.testclient import TestClient
from lora_adapters import merged_hf

from engine import LLM
from engine.async_engine import AsyncLLMEngine
from engine.entrypoints.openai.launcher import ServerProcess
from engine.entrypoints.openai.server import build_app
from engine.errors import InvalidRequestError
from engine.lora import LoRARequest
from engine.sampling.params import SamplingParams

#: the adapters served from start-up; the fourth of ``lora_adapters.ADAPTERS`` is loaded at run time
SERVED = ("attn-r8", "mlp-r4", "all-r16-rslora")
RUNTIME = "pattern"
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 8}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tiny_llama_loras):
    modules = [f"{name}={tiny_llama_loras[name]}" for name in SERVED[:2]]
    # the JSON form, with the parent /v1/models reports
    modules.append(json.dumps({"name": SERVED[2], "path": tiny_llama_loras[SERVED[2]], "base_model_name": "tiny-base"}))
    proc = ServerProcess([
        "--model", tiny_llama_dir, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "64MiB",
        "--max-model-len", "256", "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "16", "--lora-modules", *modules, "--allow-runtime-lora-updating",
    ])  # fmt: skip
    proc.start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def references(tiny_llama_dir, tiny_llama_loras):
    models = {"tiny": merged_hf(tiny_llama_dir, None)}
    models.update({name: merged_hf(tiny_llama_dir, tiny_llama_loras[name]) for name in (*SERVED, RUNTIME)})
    return models


def greedy_tokens(client: openai.OpenAI, model: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a greedy completion of PROMPT under ``model``."""
    r = client.completions.create(model=model, prompt=PROMPT, extra_body=EXTRA, **GREEDY)
    assert r.model == model
    choice = r.choices[0].model_extra
    return choice["prompt_token_ids"], choice["token_ids"]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


@pytest.mark.slow
def test_greedy_completions_of_base_and_adapters_match_hf_merged(client, references):
    # all at once: four models over two device slots, so steps swap adapters in and out
    models = ["tiny", *SERVED]
    with ThreadPoolExecutor(len(models)) as pool:
        results = dict(zip(models, pool.map(lambda m: greedy_tokens(client, m), models)))
    for model, (prompt_ids, tokens) in results.items():
        assert tokens == hf_greedy(references[model], prompt_ids, 8), model
    assert len({tuple(tokens) for _, tokens in results.values()}) == len(models)


@pytest.mark.slow
def test_chat_runs_under_an_adapter(client, references):
    messages = [{"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model=SERVED[1], messages=messages, extra_body=EXTRA, **GREEDY)
    assert r.model == SERVED[1] and r.usage.completion_tokens == 8
    extra = r.model_extra
    assert r.choices[0].model_extra["token_ids"] == hf_greedy(references[SERVED[1]], extra["prompt_token_ids"], 8)


@pytest.mark.slow
def test_models_lists_the_adapters_with_their_parent(client, server, tiny_llama_loras):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny", *SERVED]
    assert cards["tiny"].model_extra["max_model_len"] == 256 and "parent" not in cards["tiny"].model_extra
    for name in SERVED:
        assert cards[name].model_extra["root"] == tiny_llama_loras[name]
    assert cards[SERVED[0]].model_extra["parent"] == "tiny"
    assert cards[SERVED[2]].model_extra["parent"] == "tiny-base"
    assert client.models.retrieve(SERVED[0]).id == SERVED[0]


@pytest.mark.slow
def test_an_unknown_model_is_a_404(client, server):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-adapter", prompt=PROMPT, **GREEDY)
    error = exc.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model" and "no-such-adapter" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}])
    r = post(server, "/v1/responses", {"model": "no-such-adapter", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.slow
def test_embeddings_under_an_adapter_and_scores_refuse_one(client, server, references):
    got = client.embeddings.create(model=SERVED[0], input=PROMPT)
    assert got.model == SERVED[0]
    want = last_token_state(references[SERVED[0]], got_ids(server))
    assert max(abs(a - b) for a, b in zip(got.data[0].embedding, want)) < 1e-4
    base = client.embeddings.create(model="tiny", input=PROMPT).data[0].embedding
    assert max(abs(a - b) for a, b in zip(got.data[0].embedding, base)) > 1e-3
    r = post(server, "/score", {"model": SERVED[0], "text_1": "a", "text_2": "b"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model"


def got_ids(server) -> list[int]:
    r = post(server, "/tokenize", {"model": "tiny", "prompt": PROMPT})
    return r.json()["tokens"]


def last_token_state(hf, ids: list[int]) -> list[float]:
    """HF's normalized final hidden state of the last prompt token (the engine's default pooling of a
    causal LM)."""
    import torch

    with torch.no_grad():
        state = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(state, dim=-1).tolist()


@pytest.mark.slow
def test_runtime_load_use_unload(client, server, tiny_llama_loras, references):
    r = post(server, "/v1/load_lora_adapter", {"lora_name": RUNTIME, "lora_path": tiny_llama_loras[RUNTIME]})
    assert r.status_code == 200 and RUNTIME in r.text
    assert [m.id for m in client.models.list().data][-1] == RUNTIME
    prompt_ids, tokens = greedy_tokens(client, RUNTIME)
    assert tokens == hf_greedy(references[RUNTIME], prompt_ids, 8)
    again = post(server, "/v1/load_lora_adapter", {"lora_name": RUNTIME, "lora_path": tiny_llama_loras[RUNTIME]})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"

    r = post(server, "/v1/unload_lora_adapter", {"lora_name": RUNTIME})
    assert r.status_code == 200, r.text
    assert RUNTIME not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        greedy_tokens(client, RUNTIME)
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": RUNTIME}).status_code == 404
    # loaded again under a new id, it serves the same tokens
    assert post(server, "/v1/load_lora_adapter", {"lora_name": RUNTIME, "lora_path": tiny_llama_loras[RUNTIME]}).status_code == 200
    assert greedy_tokens(client, RUNTIME)[1] == tokens
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": RUNTIME}).status_code == 200


@pytest.mark.slow
def test_a_broken_adapter_is_a_400_and_the_server_goes_on(client, server, tiny_llama_loras, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_loras[RUNTIME], broken)
    (broken / "adapter_config.json").write_text("{not json")
    before = [m.id for m in client.models.list().data]
    for path in (str(broken), str(tmp_path / "missing")):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": path})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "broken" in message and "\n" not in message
    assert [m.id for m in client.models.list().data] == before
    with pytest.raises(openai.NotFoundError):
        greedy_tokens(client, "broken")
    assert len(greedy_tokens(client, SERVED[0])[1]) == 8


def tiny_lora_llm(path: str) -> LLM:
    return LLM(path, device="cpu", dtype="float32", enable_lora=True, max_loras=2, kv_cache_memory_bytes=32 << 20, max_model_len=256)


def test_async_engine_adds_and_removes_adapters_on_its_thread(tiny_llama_dir, tiny_llama_loras):
    engine = AsyncLLMEngine(tiny_lora_llm(tiny_llama_dir).llm_engine)
    lora = LoRARequest(SERVED[0], 1, tiny_llama_loras[SERVED[0]])

    async def main() -> None:
        assert await engine.add_lora(lora) is True
        assert await engine.add_lora(lora) is False
        with pytest.raises(InvalidRequestError, match="not a folder"):
            await engine.add_lora(LoRARequest("gone", 2, os.path.join(tiny_llama_dir, "missing")))
        assert await engine.list_loras() == [lora]
        # a request still runs under it (the removal is queued right behind it): refused, nothing changes
        stream = await engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), lora_request=lora)
        with pytest.raises(InvalidRequestError, match="running"):
            await engine.remove_lora(1)
        assert [o async for o in stream][-1].finished
        assert await engine.remove_lora(1) is True
        assert await engine.remove_lora(1) is False
        assert await engine.list_loras() == []

    asyncio.run(main())
    engine.shutdown()


def test_runtime_routes_are_absent_without_the_flag(tiny_llama_dir, tiny_llama_loras):
    engine = AsyncLLMEngine(tiny_lora_llm(tiny_llama_dir).llm_engine)
    lora = LoRARequest(SERVED[0], 1, tiny_llama_loras[SERVED[0]])
    engine.engine.add_lora(lora)
    with TestClient(build_app(engine, served_model_names=["tiny"], lora_requests=[lora])) as http:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = http.post(path, json={"lora_name": "x", "lora_path": tiny_llama_loras[RUNTIME]})
            assert r.status_code == 404 and r.json()["error"]["message"].startswith("no route")
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", SERVED[0]]
        r = http.post("/v1/completions", json={"model": SERVED[0], "prompt": PROMPT, **GREEDY})
        assert r.status_code == 200 and r.json()["model"] == SERVED[0]

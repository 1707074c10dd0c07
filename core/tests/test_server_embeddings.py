"""POST /v1/embeddings with the official openai client (which asks for base64 by default), in process
on a tiny embedding model: the vectors equal LLM.embed's and sentence-transformers' (cosine >= 0.9999)."""

from __future__ import annotations

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from test_embeddings import save_embedding_model, st_embeddings

from engine import LLM
from engine.async_engine import AsyncLLMEngine
from engine.entrypoints.openai.server import build_app

TEXTS = ["The food was delicious", "A quick brown fox", "Paris is the capital of France"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, hf_tokenizer_dir):
    return save_embedding_model(str(tmp_path_factory.mktemp("embed")), hf_tokenizer_dir, "lasttoken", True)


@pytest.fixture(scope="module")
def http(model_dir):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    with TestClient(build_app(AsyncLLMEngine(llm.llm_engine))) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)


def test_openai_client_embeddings_equal_sentence_transformers(client, model_dir):
    model = client.models.list().data[0].id
    response = client.embeddings.create(model=model, input=TEXTS)  # base64 on the wire
    got = torch.tensor([d.embedding for d in sorted(response.data, key=lambda d: d.index)])
    expected = st_embeddings(model_dir, TEXTS)
    assert torch.nn.functional.cosine_similarity(got.double(), expected.double()).min() >= 0.9999
    assert response.usage.prompt_tokens == response.usage.total_tokens > 0
    floats = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    assert torch.allclose(torch.tensor(floats.data[0].embedding), got[0], atol=1e-6)


def test_dimensions_and_token_ids(client, http):
    model = client.models.list().data[0].id
    ids = [1, 504, 3458, 282]
    short = client.embeddings.create(model=model, input=[ids], dimensions=16)
    vector = torch.tensor(short.data[0].embedding)
    assert vector.shape == (16,) and abs(vector.norm().item() - 1.0) < 1e-5
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=model, input="x", dimensions=4096)
    assert info.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=model, input=[])
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert response.status_code == 400 and "no LM head" in response.json()["error"]["message"]

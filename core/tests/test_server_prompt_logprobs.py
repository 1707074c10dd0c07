"""Scoring prompts over HTTP as evaluation harnesses do: ``echo`` with ``logprobs`` (also with
``max_tokens: 0`` and prompts as token-id lists) and ``prompt_logprobs`` on ``/v1/completions``; the values
equal HF transformers' float32 log-softmax within 1e-4."""

from __future__ import annotations

import json

import pytest
import torch
from dense_model_utils import load_hf
from fastapi.testclient import TestClient
from test_server_routes import tiny_engine

from engine.entrypoints.openai.server import build_app


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    with TestClient(build_app(tiny_engine(tiny_llama_dir))) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    hf = load_hf(tiny_llama_dir)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def _model(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def test_echo_with_logprobs_and_no_new_tokens_scores_token_id_prompts(client, reference):
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 19556, 28, 216, 33, 8432, 30]]
    body = {"model": _model(client), "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["usage"]["completion_tokens"] == 0
    assert data["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    for choice, ids in zip(sorted(data["choices"], key=lambda c: c["index"]), prompts):
        logprobs, expected = choice["logprobs"], reference(ids)
        assert choice["finish_reason"] == "length"
        assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None
        for position in range(1, len(ids)):
            assert logprobs["token_logprobs"][position] == pytest.approx(expected[position - 1, ids[position]].item(), abs=1e-4)
            assert len(logprobs["top_logprobs"][position]) == 2
            best = expected[position - 1].max().item()
            assert max(logprobs["top_logprobs"][position].values()) == pytest.approx(best, abs=1e-4)
        assert "".join(logprobs["tokens"]) == choice["text"]


def test_echo_with_logprobs_puts_the_prompt_before_the_completion(client, reference):
    body = {"model": _model(client), "prompt": "The capital of France", "max_tokens": 3, "echo": True, "logprobs": 0, "temperature": 0}
    data = client.post("/v1/completions", json=body).json()
    choice = data["choices"][0]
    prompt_len = data["usage"]["prompt_tokens"]
    assert len(choice["logprobs"]["tokens"]) == prompt_len + data["usage"]["completion_tokens"]
    assert choice["text"].startswith("The capital of France")
    assert all(v is not None for v in choice["logprobs"]["token_logprobs"][1:])
    assert choice["logprobs"]["text_offset"] == sorted(choice["logprobs"]["text_offset"])


def test_prompt_logprobs_field(client, reference):
    ids = [1, 504, 3458, 282]
    body = {"model": _model(client), "prompt": ids, "max_tokens": 1, "prompt_logprobs": 1}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    expected = reference(ids)
    for position in range(1, len(ids)):
        entry = entries[position][str(ids[position])]
        assert entry["logprob"] == pytest.approx(expected[position - 1, ids[position]].item(), abs=1e-4)
        assert entry["rank"] >= 1


def test_streamed_echo_carries_the_prompt_logprobs_first(client):
    body = {"model": _model(client), "prompt": [1, 504, 3458, 282], "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) == 4
    body["prompt_logprobs"] = 1
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"

"""/classify, /score, /rerank (and /v1/rerank) and /pooling on a tiny sequence classifier, in process:
the values equal LLM.classify / LLM.score (themselves checked against HF)."""

from __future__ import annotations

import pytest
from dense_model_utils import save_tiny
from fastapi.testclient import TestClient

from engine import LLM
from engine.async_engine import AsyncLLMEngine
from engine.entrypoints.openai.server import build_app

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel tower is in Paris."]


@pytest.fixture(scope="module")
def served(tmp_path_factory, hf_tokenizer_dir):
    path = save_tiny(
        "Qwen2ForSequenceClassification", str(tmp_path_factory.mktemp("cls")), hf_tokenizer_dir, num_labels=1, pad_token_id=0
    )  # fmt: skip
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    expected = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    with TestClient(build_app(AsyncLLMEngine(llm.llm_engine))) as client:
        yield client, expected


def test_score_and_rerank(served):
    client, expected = served
    scores = client.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(expected, abs=1e-6)
    for route in ("/rerank", "/v1/rerank"):
        ranked = client.post(route, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in ranked["results"]] == order
        assert ranked["results"][0]["document"]["text"] == DOCUMENTS[order[0]]
        assert ranked["results"][0]["relevance_score"] == pytest.approx(expected[order[0]], abs=1e-6)
    bad = client.post("/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"


def test_classify_and_pooling(served):
    client, _ = served
    data = client.post("/classify", json={"input": ["I loved it", "I hated it"]}).json()["data"]
    assert len(data) == 2 and all(d["num_classes"] == 1 and 0 < d["probs"][0] < 1 for d in data)
    pooled = client.post("/pooling", json={"input": "I loved it"}).json()["data"][0]["data"]
    assert len(pooled) == 128
    tokens = client.post("/pooling", json={"input": [5, 6, 7], "task": "token_embed", "normalize": False}).json()
    assert [len(row) for row in tokens["data"][0]["data"]] == [128, 128, 128]
    probs = client.post("/pooling", json={"input": [5, 6, 7, 8], "task": "token_classify"}).json()["data"][0]["data"]
    assert len(probs) == 4 and all(len(row) == 1 and 0 < row[0] < 1 for row in probs)
    bad = client.post("/pooling", json={"input": "x", "task": "generate"})
    assert bad.status_code == 400 and "task" in bad.text
    unknown = client.post("/rerank", json={"query": "q", "documents": ["d"], "frobnicate": 1})
    assert unknown.status_code == 400 and "frobnicate" in unknown.text

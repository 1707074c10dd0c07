"""ModernBERT (``ModernBertModel``, ``ModernBertForSequenceClassification``) on tiny seeded checkpoints with the
WordPiece tokenizer of test_encoders: four layers (global, local, local, global), ``local_attention=8`` (a
local layer sees ``|i - j| <= 4``) so that most prompts run past a local window, and distinct rotary bases
per layer kind. Embeddings against sentence-transformers (cosine >= 0.9999), classifier scores against HF
transformers (within 1e-4, CLS and mean classifier pooling), ``/v1/embeddings`` with the openai client; all
in float32 on the CPU, prompts of several lengths batched in one step."""

from __future__ import annotations

import dataclasses
import os

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from test_embeddings import st_embeddings
from test_encoders import DOCUMENTS, save_wordpiece_tokenizer

from engine import LLM, SamplingParams
from engine.async_engine import AsyncLLMEngine
from engine.entrypoints.openai.server import build_app
from engine.errors import InvalidRequestError
from engine.models.config import ModelConfig
from engine.models.modernbert import ModernBertModel, layer_types, rope_parameters
from engine_test_utils import assert_all_blocks_free, write_sentence_transformers_files

#: one prompt within a local window (5 tokens: every pair within 4), the rest past it, the last 36 tokens long
TEXTS = [
    "Bananas are yellow",
    "The food was delicious and the waiter was kind.",
    "Paris is the capital of France.",
    "What is the capital of France? A quick brown fox jumps over the lazy dog!",
    "The food was delicious and the waiter was kind. A quick brown fox jumps over the lazy dog! "
    "Paris is the capital of France. What is the capital of France?",
]
QUERY = "What is the capital of France?"
HIDDEN = 64


def save_modernbert(
    out: str, labels: int | None = None, pooling: str = "mean_tokens", classifier_pooling: str = "cls", biases: bool = False
) -> str:
    """A seeded ModernBERT folder: the encoder with sentence-transformers files (Transformer, Pooling, Normalize),
    or, with ``labels``, a sequence classifier; ``biases`` turns on every optional bias."""
    import transformers

    os.makedirs(out, exist_ok=True)
    vocab = save_wordpiece_tokenizer(out)
    config = transformers.ModernBertConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=128, local_attention=8, global_attn_every_n_layers=3,
        global_rope_theta=1000.0, local_rope_theta=50.0, classifier_pooling=classifier_pooling,
        norm_bias=biases, attention_bias=biases, mlp_bias=biases, classifier_bias=biases,
        pad_token_id=0, bos_token_id=3, cls_token_id=3, eos_token_id=4, sep_token_id=4,
    )  # fmt: skip
    if labels:
        config.num_labels = labels
    torch.manual_seed(0)
    model = (transformers.ModernBertForSequenceClassification if labels else transformers.ModernBertModel)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    if not labels:
        write_sentence_transformers_files(out, HIDDEN, pooling)
    return out


def _llm(path: str) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)


def _hf_logits(path: str, pairs: list[tuple[str, ...]]) -> torch.Tensor:
    """HF's logits ``[len(pairs), labels]``, one unpadded input at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = []
    with torch.no_grad():
        for pair in pairs:
            ids = tokenizer(*pair, return_tensors="pt")["input_ids"]
            rows.append(model(input_ids=ids).logits[0])
    return torch.stack(rows)


def test_the_test_prompts_run_past_a_local_window(tmp_path):
    from transformers import AutoTokenizer

    save_wordpiece_tokenizer(str(tmp_path))
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(str(tmp_path))(TEXTS)["input_ids"]]
    assert lengths[0] <= 5 < min(lengths[1:]) and max(lengths) > 32  # 5 = local_attention // 2 + 1


@pytest.mark.parametrize("pooling", ["mean_tokens", "cls_token"])
def test_embeddings_match_sentence_transformers(pooling, tmp_path, monkeypatch):
    path = save_modernbert(str(tmp_path), pooling=pooling)
    expected = st_embeddings(path, TEXTS)
    llm = _llm(path)
    model, pruned = llm.llm_engine.model, []
    forward = model.forward

    def spy(*args, **kwargs):
        pruned.append(kwargs.get("output_rows") is not None)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    got = torch.stack([torch.tensor(o.outputs.embedding) for o in llm.embed(TEXTS, use_tqdm=False)])
    assert got.shape == (len(TEXTS), HIDDEN)
    # CLS pooling reads one row a prompt: the last layer runs past its attention on those rows only
    assert pruned and all(pruned) == (pooling == "cls_token")
    assert torch.nn.functional.cosine_similarity(got.double(), expected.double()).min() >= 0.9999
    with pytest.raises(InvalidRequestError, match="no LM head"):
        llm.generate(TEXTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(("classifier_pooling", "biases"), [("cls", False), ("mean", False), ("mean", True)])
def test_classifier_scores_match_hf(classifier_pooling, biases, tmp_path):
    scorer = save_modernbert(str(tmp_path / "scorer"), labels=1, classifier_pooling=classifier_pooling, biases=biases)
    llm = _llm(scorer)
    scores = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS + TEXTS, use_tqdm=False)]
    expected = torch.sigmoid(_hf_logits(scorer, [(QUERY, d) for d in DOCUMENTS + TEXTS])[:, 0])
    assert scores == pytest.approx(expected.tolist(), abs=1e-4)
    assert_all_blocks_free(llm)

    classifier = save_modernbert(str(tmp_path / "labels"), labels=3, classifier_pooling=classifier_pooling, biases=biases)
    llm = _llm(classifier)
    probs = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    expected = torch.softmax(_hf_logits(classifier, [(t,) for t in TEXTS]), dim=-1)
    assert torch.allclose(probs, expected, atol=1e-4), (probs - expected).abs().max()
    assert_all_blocks_free(llm)


def test_openai_client_embeddings_match_sentence_transformers(tmp_path):
    path = save_modernbert(str(tmp_path))
    llm = _llm(path)
    with TestClient(build_app(AsyncLLMEngine(llm.llm_engine))) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)
        response = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS)
    got = torch.tensor([d.embedding for d in sorted(response.data, key=lambda d: d.index)])
    expected = st_embeddings(path, TEXTS)
    assert torch.nn.functional.cosine_similarity(got.double(), expected.double()).min() >= 0.9999


def test_hub_style_and_transformers_5_configs_read_alike():
    """Hub checkpoints predate ``layer_types`` / ``rope_parameters``: every third layer global from layer 0,
    ``global_rope_theta`` / ``local_rope_theta``; transformers 5 writes the same as per-kind dicts."""
    hub = {"num_hidden_layers": 7, "global_attn_every_n_layers": 3, "global_rope_theta": 160000.0, "local_rope_theta": 10000.0}
    assert layer_types(hub) == ["full_attention", "sliding_attention", "sliding_attention"] * 2 + ["full_attention"]
    assert rope_parameters(hub, "full_attention") == (160000.0, None)
    assert rope_parameters(hub, "sliding_attention") == (10000.0, None)
    v5 = {
        "num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000.0}, "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
    }  # fmt: skip
    assert layer_types(v5) == ["full_attention", "sliding_attention"]
    assert rope_parameters(v5, "full_attention") == (1000.0, None) and rope_parameters(v5, "sliding_attention") == (50.0, None)
    config = ModelConfig("ModernBertModel", 10, 64, 96, 2, 2, 2, 32, hf_config={**v5, "local_attention": 128})
    assert ModernBertModel.local_window(config) == 65  # HF: |i - j| <= 64
    assert "non_causal_sliding_window" in ModernBertModel.required_features(config)
    all_global = dataclasses.replace(config, hf_config={**v5, "layer_types": ["full_attention"] * 2})
    assert ModernBertModel.required_features(all_global) == {"non_causal_attention": "bidirectional (encoder) attention"}
    with pytest.raises(ValueError, match="hidden_activation 'gelu_accurate' is not supported"):
        ModernBertModel.config_from_hf({**v5, "hidden_activation": "gelu_accurate", "vocab_size": 10, "hidden_size": 64,
                                        "intermediate_size": 96, "num_attention_heads": 2})  # fmt: skip


def test_a_platform_without_symmetric_windows_refuses_the_model(tmp_path, monkeypatch):
    from engine.engine_setup import EngineConfigError
    from engine_plugin_cpu.platform import CpuPlatform

    path = save_modernbert(str(tmp_path))
    original = CpuPlatform.capabilities
    monkeypatch.setattr(CpuPlatform, "capabilities", lambda self: dataclasses.replace(original(self), non_causal_sliding_window=False))
    with pytest.raises(EngineConfigError, match="ModernBertModel needs bidirectional sliding-window \\(local\\) attention, which cpu does not support"):
        _llm(path)

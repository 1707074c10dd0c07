"""Pooling requests (``LLM.embed``): decoder embedding models against sentence-transformers in float32
(cosine >= 0.9999), with the pooling their sentence-transformers files declare, in chunks, Matryoshka
dimensions, and a causal LM pooled by its last token."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from dense_model_utils import PROMPTS, load_hf

from engine import LLM, PoolingParams, SamplingParams
from engine.errors import InvalidRequestError
from engine_test_utils import assert_all_blocks_free, write_sentence_transformers_files

TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
)  # fmt: skip


def save_embedding_model(out: str, tokenizer_dir: str, pooling: str = "lasttoken", normalize: bool = True) -> str:
    """A seeded tiny ``Qwen3Model`` with sentence-transformers' files: Transformer, Pooling(, Normalize)."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    model = Qwen3Model(Qwen3Config(**TINY))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out)
    write_sentence_transformers_files(out, TINY["hidden_size"], pooling, normalize)
    with open(os.path.join(out, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 256, "do_lower_case": False}, f)
    return out


def st_embeddings(path: str, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch.float32})
    # one text per batch: no padding to reason about
    return torch.stack([torch.as_tensor(model.encode([t], convert_to_numpy=True)[0]) for t in texts])


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, **kwargs)


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


@pytest.mark.parametrize(("pooling", "normalize"), [("lasttoken", True), ("mean_tokens", False)], ids=["last-normalized", "mean"])
def test_embeddings_match_sentence_transformers(tmp_path, hf_tokenizer_dir, pooling, normalize):
    path = save_embedding_model(str(tmp_path), hf_tokenizer_dir, pooling, normalize)
    expected = st_embeddings(path, PROMPTS)
    for extra in ({}, dict(max_num_batched_tokens=8, block_size=8)):  # whole prompts, then chunks of 8
        llm = _llm(path, **extra)
        outs = llm.embed(PROMPTS, use_tqdm=False)
        got = torch.stack([torch.tensor(o.outputs.embedding) for o in outs])
        assert got.shape == expected.shape
        assert _cosines(got, expected).min() >= 0.9999
        if normalize:
            assert torch.allclose(got.norm(dim=-1), torch.ones(len(PROMPTS)), atol=1e-5)
        else:
            assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
        assert_all_blocks_free(llm)


def test_dimensions_cut_before_normalizing_and_generation_is_refused(tmp_path, hf_tokenizer_dir):
    path = save_embedding_model(str(tmp_path), hf_tokenizer_dir, "mean_tokens", normalize=False)
    llm = _llm(path)
    full = torch.tensor(llm.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding)
    cut = torch.tensor(llm.embed(PROMPTS[0], PoolingParams(dimensions=16, normalize=True), use_tqdm=False)[0].outputs.embedding)
    assert torch.allclose(cut, torch.nn.functional.normalize(full[:16], dim=-1), atol=1e-6)
    with pytest.raises(InvalidRequestError, match="dimensions 65 exceeds"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="no LM head"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_a_causal_lm_pooled_by_its_last_token_and_mixed_with_generation(tiny_llama_dir):
    hf = load_hf(tiny_llama_dir)
    llm = _llm(tiny_llama_dir)
    ids = llm.tokenizer.encode(PROMPTS[1])
    with torch.no_grad():
        states = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
    vector = torch.tensor(llm.embed([ids], use_tqdm=False)[0].outputs.embedding)
    assert _cosines(vector, states).item() >= 0.9999
    # generation and pooling requests in the same steps
    engine = llm.llm_engine
    engine.add_request("gen", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request("emb", ids, PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert len(finished["gen"].outputs[0].token_ids) == 4
    assert torch.allclose(finished["emb"].outputs.data, vector, atol=1e-5)
    assert_all_blocks_free(llm)


def test_the_runner_option_limits_what_an_engine_takes(tiny_llama_dir):
    pooling = _llm(tiny_llama_dir, task="embed")  # the older spelling of runner="pooling"
    assert len(pooling.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding) == 256  # the tiny Llama's width
    with pytest.raises(InvalidRequestError, match="runner='pooling'"):
        pooling.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    generating = _llm(tiny_llama_dir, runner="generate")
    with pytest.raises(InvalidRequestError, match="runner='generate'"):
        generating.embed(PROMPTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="task must be"):
        _llm(tiny_llama_dir, task="translate")

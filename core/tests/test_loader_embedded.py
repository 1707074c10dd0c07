"""The embedded SmolLM2 GGUF: config, dequantised weights against transformers' GGUF loader, tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from engine.loader import (
    ModelLoadError,
    Tokenizer,
    iter_weights,
    load_model_config,
    load_tokenizer,
    resolve_model_path,
)
from engine.loader.gguf_reader import GgufFile
from engine.models.config import ModelConfig

SMOLLM2_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    attention_bias=False,
    bos_token_id=1,
    eos_token_ids=[2],
    torch_dtype="float32",
)


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model_path(None)


@pytest.fixture(scope="module")
def tokenizer(gguf_path: str) -> Tokenizer:
    return load_tokenizer(gguf_path)


def test_embedded_config(gguf_path: str) -> None:
    config = load_model_config(gguf_path)
    assert config.rms_norm_eps == pytest.approx(1e-5)
    config.rms_norm_eps = SMOLLM2_CONFIG.rms_norm_eps
    assert config == SMOLLM2_CONFIG


@pytest.mark.slow
def test_embedded_weights_match_transformers(gguf_path: str, hf_smollm2) -> None:
    config = load_model_config(gguf_path)
    loaded = dict(iter_weights(gguf_path, config))
    reference = dict(hf_smollm2.state_dict())
    reference.pop("lm_head.weight")  # tied to the embeddings
    assert sorted(loaded) == sorted(reference)
    # the engine's GGUF reader, checked against gguf's GGUFReader in test_gguf_reader.py (which decodes every
    # token string of the metadata: seconds for this file)
    types = {t.name: t.tensor_type for t in GgufFile(gguf_path).tensors}
    # The file is Q4_1 with a Q8_0 embedding: check both kinds, and Q/K, whose rows must be un-permuted.
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q4_1
    assert types["token_embd.weight"] == GGMLQuantizationType.Q8_0
    for name, tensor in reference.items():
        ours = loaded[name]
        assert ours.dtype == tensor.dtype == torch.float32 and ours.shape == tensor.shape, name
        # assert_close's test at rtol=0 in one pass (a NaN fails it too); assert_close itself, several times
        # slower over 135M weights, only to report a tensor that fails it
        if not (ours - tensor).abs().max() <= 1e-6:
            torch.testing.assert_close(ours, tensor, rtol=0, atol=1e-6, msg=name)


def test_tokenizer_round_trip(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_ids == [2]
    assert tokenizer.bos_token_id == 1
    text = "Paged attention keeps KV blocks; émigré 東京 123!"
    ids = tokenizer.encode(text)
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens([2]) == ["<|im_end|>"]
    assert tokenizer.decode([*ids, 2]) == text
    assert tokenizer.decode([*ids, 2], skip_special_tokens=False) == text + "<|im_end|>"


def test_chat_template(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    assert tokenizer.apply_chat_template([{"role": "user", "content": parts}]) == prompt
    no_prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False,
    )
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


@pytest.mark.parametrize(
    "messages,match",
    [
        ([{"content": "hi"}], "role None"),
        ([{"role": "robot", "content": "hi"}], "role 'robot'"),
        ([{"role": "user"}], "no 'content'"),
        ([{"role": "user", "content": 3}], "string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "content part"),
        (["hello"], "must be an object"),
        ([], "non-empty"),
    ],
)
def test_bad_chat_messages(tokenizer: Tokenizer, messages: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tokenizer.apply_chat_template(messages)


def test_folder_tokenizer_and_missing_template(tokenizer: Tokenizer, tmp_path: Path) -> None:
    tokenizer.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    folder = load_tokenizer(str(tmp_path))
    assert folder.eos_token_ids == [2, 0]
    text = "Hello, world! How are you?"
    assert folder.encode(text) == tokenizer.encode(text)
    folder.hf.chat_template = None
    with pytest.raises(ModelLoadError, match="no chat template"):
        folder.apply_chat_template([{"role": "user", "content": "hi"}])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="cannot load a tokenizer"):
        load_tokenizer(str(empty))


def test_gguf_tokenizer_is_cached_between_loads_and_behaves_the_same(smollm_gguf_path, tmp_path, monkeypatch):

    from engine.loader.tokenizer import load_tokenizer, tokenizer_cache_dir

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    cache = tokenizer_cache_dir(smollm_gguf_path)
    assert not os.path.exists(cache)
    converted = load_tokenizer(smollm_gguf_path)
    assert os.path.isfile(os.path.join(cache, "tokenizer_config.json"))
    cached = load_tokenizer(smollm_gguf_path)
    text = "Héllo wörld, 你好 🙂 <|im_end|> def f(x): return x"
    assert cached.encode(text) == converted.encode(text)
    assert cached.decode(converted.encode(text)) == converted.decode(converted.encode(text))
    assert cached.eos_token_ids == converted.eos_token_ids
    chat = [{"role": "user", "content": "Hi"}]
    assert cached.apply_chat_template(chat) == converted.apply_chat_template(chat)
    assert cached.vocab_size == converted.vocab_size

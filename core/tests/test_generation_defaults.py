"""A checkpoint's own settings: generation_config.json sampling defaults (``--generation-config``) and its
chat template (``chat_template.jinja`` first, then ``tokenizer_config.json``)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine import LLM
from engine.async_engine import AsyncLLMEngine
from engine.entrypoints.cli import build_parser, engine_config_from_args
from engine.entrypoints.openai.protocol import CompletionRequest
from engine.entrypoints.openai.server import build_app
from engine.entrypoints.openai.serving_common import ServingContext, sampling_params
from engine.loader.generation_defaults import format_generation_defaults, read_generation_defaults
from engine.loader.tokenizer import folder_chat_template
from engine.sampling.params import SamplingParams

#: a template whose rendering no real model's template produces
JINJA_TEMPLATE = "JINJA{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
PROMPT = "The capital of France is"


def linked_copy(src: str, dest: Path, skip: tuple[str, ...] = ()) -> Path:
    """``src``'s files linked into ``dest`` (the weights are not copied), leaving out ``skip``."""
    dest.mkdir()
    for name in os.listdir(src):
        if name not in skip:
            os.symlink(os.path.join(src, name), dest / name)
    return dest


@pytest.fixture(scope="module")
def greedy_default_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama whose generation_config.json makes unset-temperature requests greedy."""
    folder = linked_copy(tiny_llama_dir, tmp_path_factory.mktemp("gen") / "model", skip=("generation_config.json",))
    config = {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0, "top_p": 0.9, "top_k": 5}
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def tiny_llm(path: str, **kwargs: object) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256, **kwargs)


def test_read_generation_defaults_keeps_valid_sampling_fields(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert read_generation_defaults(str(tmp_path)) == {}  # no file
    raw = {"temperature": 0.6, "top_p": 0.0, "top_k": 20, "min_p": "x", "repetition_penalty": 1.1, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING):
        defaults = read_generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}
    assert "top_p=0.0" in caplog.text and "min_p='x'" in caplog.text  # refused values are named, not fatal
    assert format_generation_defaults(defaults) == "temperature=0.6, top_k=20, repetition_penalty=1.1"
    assert read_generation_defaults(str(tmp_path / "model.gguf")) == {}  # a file, not a folder


def test_llm_uses_checkpoint_defaults_only_without_sampling_params(
    greedy_default_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        llm = tiny_llm(greedy_default_dir)
    assert "using the checkpoint's generation defaults: temperature=0.0, top_p=0.9, top_k=5" in caplog.text
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.0, 0.9, 5)
    unset = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert unset.token_ids == greedy.token_ids  # the default temperature 0 made the unset call greedy
    # explicit SamplingParams are used as they are: the engine's temperature 1.0, not the checkpoint's 0
    assert SamplingParams().temperature == 1.0
    none = tiny_llm(greedy_default_dir, generation_config="none")
    assert none.get_default_sampling_params() == SamplingParams()
    assert none.llm_engine.generation_defaults == {}


def test_server_request_fields_win_over_checkpoint_defaults() -> None:
    ctx = ServingContext(engine=None, served_model_names=["m"], vocab_size=100,  # type: ignore[arg-type]
                         generation_defaults={"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.2})
    unset = sampling_params(CompletionRequest(prompt="x"), ctx, 8, None)
    assert isinstance(unset, SamplingParams)
    assert (unset.temperature, unset.top_k, unset.repetition_penalty, unset.top_p) == (0.0, 5, 1.2, 1.0)
    given = sampling_params(CompletionRequest(prompt="x", temperature=0.8, top_k=-1), ctx, 8, None)
    assert isinstance(given, SamplingParams)
    assert (given.temperature, given.top_k, given.repetition_penalty) == (0.8, -1, 1.2)
    ctx.generation_defaults = {}
    plain = sampling_params(CompletionRequest(prompt="x"), ctx, 8, None)
    assert isinstance(plain, SamplingParams)
    assert (plain.temperature, plain.top_k, plain.min_p, plain.repetition_penalty) == (1.0, -1, 0.0, 1.0)


def test_server_unset_temperature_is_the_checkpoint_greedy(greedy_default_dir: str) -> None:
    with TestClient(build_app(AsyncLLMEngine(tiny_llm(greedy_default_dir).llm_engine))) as client:
        def complete(**fields: object) -> str:
            body = {"prompt": PROMPT, "max_tokens": 12, **fields}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        assert complete() == complete(temperature=0.0) == complete(temperature=0.0, top_k=1)


def test_cli_generation_config_flag() -> None:
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["generate", "hi"])).generation_config == "auto"
    args = parser.parse_args(["serve", "--generation-config", "none"])
    assert engine_config_from_args(args).generation_config == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--generation-config", "vllm"])


def test_chat_template_jinja_wins_over_tokenizer_config(tiny_llama_dir: str, tmp_path: Path) -> None:
    # not linked: writing through a link would change the session's shared tiny model for later tests
    folder = linked_copy(tiny_llama_dir, tmp_path / "model", skip=("chat_template.jinja",))
    (folder / "chat_template.jinja").write_text(JINJA_TEMPLATE)
    llm = tiny_llm(str(folder))
    messages = [{"role": "user", "content": "hi"}]
    assert llm.tokenizer.apply_chat_template(messages) == "JINJA[user:hi]"
    with TestClient(build_app(AsyncLLMEngine(llm.llm_engine))) as client:
        tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert llm.tokenizer.decode(tokens, skip_special_tokens=False) == "JINJA[user:hi]"


def test_folder_chat_template_sources(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "TC{{ messages }}"}))
    assert folder_chat_template(str(tmp_path), has_template=False) == "TC{{ messages }}"
    assert folder_chat_template(str(tmp_path), has_template=True) is None  # the tokenizer's own stays
    (tmp_path / "chat_template.jinja").write_text(JINJA_TEMPLATE)
    assert folder_chat_template(str(tmp_path), has_template=True) == JINJA_TEMPLATE
    other = tmp_path / "processor"
    other.mkdir()
    (other / "chat_template.json").write_text(json.dumps({"chat_template": "P{{ messages }}"}))
    assert folder_chat_template(str(other), has_template=False) == "P{{ messages }}"

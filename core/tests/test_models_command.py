"""``engine models`` lists what the core and the plugins load; an unsupported checkpoint names the closest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM
from engine.entrypoints.cli import main
from engine.loader.errors import ModelLoadError
from engine.models.registry import CORE_SOURCE, ModelRegistry, closest_architectures
from engine.plugins.manager import PluginManager


def test_models_table_lists_every_architecture_with_its_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ARCHITECTURE", "SOURCE", "GGUF"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    registry = ModelRegistry.from_plugins(PluginManager())
    assert list(rows) == registry.supported()
    assert rows["LlamaForCausalLM"] == [CORE_SOURCE, "llama"]
    assert rows["Qwen3ForCausalLM"][0] == CORE_SOURCE


def test_models_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    registry = ModelRegistry.from_plugins(PluginManager())
    by_name = {m["architecture"]: m for m in report["models"]}
    assert list(by_name) == registry.supported()
    assert all(by_name[name]["source"] == registry.sources[name] for name in by_name)
    assert by_name["Qwen2ForCausalLM"]["gguf"] == ["qwen2"]
    assert report["refused"] == list(registry.refused)


def test_closest_architectures() -> None:
    names = ModelRegistry.core().supported()
    assert closest_architectures("Qwen3NextForCausalLM", names)[:2] == ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
    assert closest_architectures("Gemma3ForConditionalGeneration", names)[0] == "Gemma3ForCausalLM"
    assert closest_architectures("Phi4MMForCausalLM", names) == ["Phi3ForCausalLM"]
    # nothing close: no family shares enough of the name (GPT-2 now finds gpt-oss, which is fair)
    assert closest_architectures("RwkvForCausalLM", names) == []
    assert closest_architectures("FalconForCausalLM", names) == []


def test_unsupported_checkpoint_names_the_closest_supported(tmp_path: Path) -> None:
    folder = tmp_path / "next"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3NextForCausalLM"], "hidden_size": 8}))
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(folder), device="cpu")
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(
        f"unsupported architecture 'Qwen3NextForCausalLM' in {folder}"
    ), message
    assert "; closest supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM" in message
    assert all(name in message.split("; all: ")[1] for name in ModelRegistry.core().supported())


def test_unsupported_checkpoint_through_the_cli_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "phi4mm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Phi4MMForCausalLM"]}))
    assert main(["generate", "hi", "--model", str(folder), "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "closest supported: Phi3ForCausalLM;" in err

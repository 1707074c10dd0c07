"""The model registry: plugin models join the core's, never replace them, and every loader resolves through it."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from engine.loader import (
    ModelLoadError,
    dummy_weights,
    expected_weight_shapes,
    iter_weights,
    load_model_config,
    supported_architectures,
)
from engine.models.base import CausalLM
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import ModelRegistry, ModelRegistryWarning
from engine.plugins.hookspecs import hookimpl
from engine.plugins.manager import PluginManager

ROOT = Path(__file__).resolve().parents[2]


class ToyForCausalLM(CausalLM):
    """Two tensors and a GGUF mapping: enough for the loader, never run."""

    gguf_architectures = types.MappingProxyType({"toyarch": "ToyForCausalLM"})
    gguf_global_tensor_names = types.MappingProxyType({"token_embd.weight": "toy.embed.weight"})
    gguf_layer_tensor_names = types.MappingProxyType({"mix.weight": "mix.weight"})
    hf_layer_prefix = "toy.blocks.{}."

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> ModelConfig:
        width = int(hf_config["width"])  # a key no Llama config has
        return ModelConfig(
            hf_config["architectures"][0], int(hf_config["vocab_size"]), width, width, 1, 1, 1, width
        )

    @classmethod
    def weight_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        h = config.hidden_size
        return {
            "toy.embed.weight": (config.vocab_size, h),
            "toy.blocks.0.mix.weight": (h, h),
            "toy.scale": (h,),
        }

    @classmethod
    def is_norm_scale(cls, name: str) -> bool:
        return name == "toy.scale"

    def load_weights(self, weights: Any) -> None:
        raise NotImplementedError

    def forward(self, input_ids: Any, positions: Any, kv_caches: Any, metadata: Any) -> Any:
        raise NotImplementedError

    def compute_logits(self, hidden: Any) -> Any:
        raise NotImplementedError


def model_plugin(name: str, models: dict[str, Any] | Exception) -> types.ModuleType:
    """An in-memory plugin module whose ``engine_register_models`` returns ``models`` (or raises it)."""
    module = types.ModuleType(name)
    module.ENGINE_PLUGIN_API = ">=2.0,<3"

    @hookimpl
    def engine_register_models() -> dict[str, Any]:
        if isinstance(models, Exception):
            raise models
        return models

    module.engine_register_models = engine_register_models
    return module


def manager_with(*modules: types.ModuleType) -> PluginManager:
    manager = PluginManager(load_entry_points=False)
    for module in modules:
        assert manager.register_module(module, name=module.__name__).status == "loaded"
    return manager


def toy_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({"architectures": ["ToyForCausalLM"], "vocab_size": 10, "width": 4})
    )
    return path


def test_core_registry() -> None:
    registry = ModelRegistry.core()
    assert registry.supported()[:3] == ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]
    assert all(registry.resolve(name, "x") is LlamaForCausalLM for name in registry.supported()[:3])
    assert {"Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"} <= set(registry)
    assert set(registry.sources.values()) == {"core"} and registry.refused == ()
    kinds = registry.gguf_architectures()
    assert list(kinds)[:2] == ["llama", "qwen2"] and kinds["qwen2"] == "Qwen2ForCausalLM"
    assert kinds["command-r"] == "CohereForCausalLM" and kinds["gemma3"] == "Gemma3ForCausalLM"
    assert supported_architectures() == registry.supported()


def test_plugin_models_join_the_registry_and_the_unsupported_message(tmp_path: Path) -> None:
    registry = ModelRegistry.from_plugins(
        manager_with(model_plugin("toy_plugin", {"ToyForCausalLM": ToyForCausalLM}))
    )
    assert registry.resolve("ToyForCausalLM", "x") is ToyForCausalLM
    assert registry.sources["ToyForCausalLM"] == "toy_plugin"
    assert supported_architectures(registry)[-1] == "ToyForCausalLM"
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'") as err:
        load_model_config(str(gpt2), registry=registry)
    assert all(name in str(err.value) for name in ["LlamaForCausalLM", "Qwen2ForCausalLM", "ToyForCausalLM"])


def test_hf_config_dummy_weights_and_stream_check_come_from_the_plugin_class(tmp_path: Path) -> None:
    registry = ModelRegistry.build([("toy_plugin", {"ToyForCausalLM": ToyForCausalLM})])
    folder = toy_folder(tmp_path / "toy")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'ToyForCausalLM'.*LlamaForCausalLM"):
        load_model_config(str(folder), check_weights=False)  # the core alone does not know it
    config = load_model_config(str(folder), check_weights=False, registry=registry)
    assert (config.architecture, config.hidden_size, config.hf_config["width"]) == ("ToyForCausalLM", 4, 4)
    weights = dict(dummy_weights(config, seed=3, registry=registry))
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_weight_shapes(config, registry)
    assert (
        abs(weights["toy.scale"].mean().item() - 1.0) < 0.1
        and abs(weights["toy.embed.weight"].mean().item()) < 0.1
    )
    # a checkpoint with names the class does not list fails the stream check, naming the tensor
    from safetensors.torch import save_file

    save_file(
        {"toy.embed.weight": torch.zeros(10, 4), "lm_head.weight": torch.zeros(10, 4)},
        str(folder / "model.safetensors"),
    )
    with pytest.raises(ModelLoadError, match="unexpected tensor 'lm_head.weight'.* for ToyForCausalLM"):
        list(iter_weights(str(folder), config, registry=registry))


def write_toy_gguf(path: Path, arch: str) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(4)
    writer.add_feed_forward_length(4)
    writer.add_head_count(1)
    writer.add_context_length(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((10, 4), dtype=np.float32))
    writer.add_tensor("blk.0.mix.weight", rng.standard_normal((4, 4), dtype=np.float32))
    writer.add_tensor("blk.0.scale_missing.weight", rng.standard_normal((4,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_kinds_and_tensor_names_come_from_the_registered_classes(tmp_path: Path) -> None:
    path = tmp_path / "toy.gguf"
    write_toy_gguf(path, "toyarch")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'toyarch' .*supported: llama, qwen2"):
        load_model_config(str(path))
    registry = ModelRegistry.build([("toy_plugin", {"ToyForCausalLM": ToyForCausalLM})])
    config = load_model_config(str(path), registry=registry)
    assert (config.architecture, config.vocab_size, config.hidden_size) == ("ToyForCausalLM", 10, 4)
    with pytest.raises(
        ModelLoadError, match=r"unknown GGUF tensor 'blk\.0\.scale_missing\.weight' for ToyForCausalLM"
    ):
        list(iter_weights(str(path), config, registry=registry))
    assert ToyForCausalLM.gguf_tensor_name("blk.0.mix.weight") == "toy.blocks.0.mix.weight"


def test_a_plugin_cannot_replace_a_core_architecture() -> None:
    class Impostor(ToyForCausalLM):
        pass

    manager = manager_with(
        model_plugin("shadowing_plugin", {"LlamaForCausalLM": Impostor, "ToyForCausalLM": ToyForCausalLM})
    )
    with pytest.warns(ModelRegistryWarning) as caught:
        registry = ModelRegistry.from_plugins(manager)
    message = str(caught[0].message)
    assert "'shadowing_plugin'" in message and "LlamaForCausalLM" in message
    assert (
        "engine.models.llama.LlamaForCausalLM" in message and "Impostor" in message and "the core" in message
    )
    assert (
        registry.resolve("LlamaForCausalLM", "x") is LlamaForCausalLM
        and registry.sources["LlamaForCausalLM"] == "core"
    )
    assert (
        registry.resolve("ToyForCausalLM", "x") is ToyForCausalLM
    )  # the plugin's other models still register
    assert len(registry.refused) == 1


def test_the_first_plugin_keeps_a_name_and_non_models_are_refused() -> None:
    class Other(ToyForCausalLM):
        pass

    with pytest.warns(ModelRegistryWarning) as caught:
        registry = ModelRegistry.build(
            [
                ("a_plugin", {"ToyForCausalLM": ToyForCausalLM}),
                ("b_plugin", {"ToyForCausalLM": Other, "Bad": object}),
            ]
        )
    assert registry.resolve("ToyForCausalLM", "x") is ToyForCausalLM and "Bad" not in registry
    messages = [str(w.message) for w in caught]
    assert any("'b_plugin'" in m and "plugin 'a_plugin'" in m for m in messages)
    assert any("'Bad'" in m and "not a subclass" in m for m in messages)


def test_a_plugin_whose_model_hook_raises_is_reported_and_skipped() -> None:
    manager = manager_with(
        model_plugin("broken_models", RuntimeError("no weights today")),
        model_plugin("fine_models", {"ToyForCausalLM": ToyForCausalLM}),
    )
    with pytest.warns(RuntimeWarning, match="'broken_models'.*no weights today"):
        registry = ModelRegistry.from_plugins(manager)
    assert "ToyForCausalLM" in registry


def test_the_example_model_plugin_imports_only_the_sdk() -> None:
    core_import = re.compile(r"^\s*(from engine(\.|\s)|import engine(\.|\s|$))")
    package = ROOT / "plugin_sdk" / "examples" / "model_plugin" / "engine_model_example"
    files = sorted(package.rglob("*.py"))
    assert files
    hits = [
        f"{p.name}: {line}" for p in files for line in p.read_text().splitlines() if core_import.match(line)
    ]
    assert not hits, hits

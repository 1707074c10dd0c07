"""Checkpoints quantized ahead of time load and run: GPTQ (4/8-bit, symmetric or not, groups, act-order,
both zero-point conventions), AWQ, compressed-tensors (W4A16 packed, FP8, INT8) and FP8 (per-tensor and
block-wise scales), each written from a tiny random Llama in its published layout. The reference is HF
transformers running the float weights the checkpoint stands for, in float32."""

from __future__ import annotations

import json
import os

import pytest
import torch
from dense_model_utils import PROMPTS, hf_greedy, load_hf, max_logit_diff, save_tiny
from prequantized_checkpoints import (
    write_awq,
    write_compressed_fp8,
    write_compressed_int8,
    write_compressed_w4a16,
    write_fp8,
    write_gptq,
)

from engine import LLM, SamplingParams
from engine.engine_setup import EngineConfigError
from engine.loader import ModelLoadError
from engine_test_utils import assert_all_blocks_free

#: case -> writer with its options (the tiny Llama: hidden 128, MLP 256, so groups of 32 / 64 / 128 fit)
CASES = {
    "gptq-4bit-g32-sym": lambda p, o, r: write_gptq(p, o, r, bits=4, group=32, symmetric=True, act_order=False),
    "gptq-4bit-g64-asym-act-order": lambda p, o, r: write_gptq(p, o, r, bits=4, group=64, symmetric=False, act_order=True),
    "gptq-8bit-per-channel": lambda p, o, r: write_gptq(p, o, r, bits=8, group=-1, symmetric=True, act_order=False),
    "gptq-v2-4bit-g128-asym": lambda p, o, r: write_gptq(p, o, r, bits=4, group=128, symmetric=False, act_order=False, v2=True),
    "awq-4bit-g64": lambda p, o, r: write_awq(p, o, r, group=64),
    "compressed-tensors-w4a16-sym": lambda p, o, r: write_compressed_w4a16(p, o, r, group=32, symmetric=True),
    "compressed-tensors-w4a16-asym": lambda p, o, r: write_compressed_w4a16(p, o, r, group=64, symmetric=False),
    "compressed-tensors-fp8-per-tensor": lambda p, o, r: write_compressed_fp8(p, o, r, per_channel=False),
    "compressed-tensors-fp8-per-channel": lambda p, o, r: write_compressed_fp8(p, o, r, per_channel=True),
    "compressed-tensors-int8": write_compressed_int8,
    "fp8-per-tensor": lambda p, o, r: write_fp8(p, o, r),
    "fp8-block-64": lambda p, o, r: write_fp8(p, o, r, block=64),
}


@pytest.fixture(scope="module")
def plain_llama(tmp_path_factory, hf_tokenizer_dir) -> str:
    return save_tiny("LlamaForCausalLM", str(tmp_path_factory.mktemp("plain")), hf_tokenizer_dir)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_a_quantized_checkpoint_matches_hf_on_its_dequantized_weights(case, plain_llama, tmp_path):
    path, reference = CASES[case](plain_llama, str(tmp_path / "quantized"), str(tmp_path / "reference"))
    hf = load_hf(reference)
    llm = _llm(path)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    diff = max_logit_diff(llm, hf, ids)
    print(f"{case}: max |logit - HF| = {diff:.2e}")
    assert diff < 1e-4, case
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, llm.tokenizer.encode(PROMPTS[1]), 6), case
    assert_all_blocks_free(llm)


def test_the_quantization_option_checks_the_checkpoint_method(plain_llama, tmp_path, caplog):
    path, _ = write_awq(plain_llama, str(tmp_path / "awq"), str(tmp_path / "reference"))
    with pytest.raises(EngineConfigError, match="quantization 'gptq' needs a gptq checkpoint; this one is awq"):
        _llm(path, quantization="gptq")
    with pytest.raises(EngineConfigError, match="quantization 'gguf' needs a .gguf model file; this one is a folder"):
        _llm(path, quantization="gguf")
    with pytest.raises(EngineConfigError, match="quantization 'gptq' needs a gptq checkpoint; this one is awq"):
        _llm(path, quantization="gptq_marlin")  # vLLM's name for the same method
    with caplog.at_level("INFO", logger="engine.engine_setup"):
        assert _llm(path, quantization="awq").generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert any("the weights take" in r.getMessage() for r in caplog.records)


def _edit_config(path: str, edit) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_a_malformed_checkpoint_is_a_one_line_error(plain_llama, tmp_path):
    path, _ = write_gptq(plain_llama, str(tmp_path / "gptq"), str(tmp_path / "reference"), 4, 32, True, False)
    _edit_config(path, lambda q: q.update(bits=3))
    with pytest.raises(ModelLoadError, match="GPTQ with 3-bit weights is not supported"):
        _llm(path)
    _edit_config(path, lambda q: q.update(bits=4, quant_method="bitsandbytes"))
    with pytest.raises(ModelLoadError, match="quantization method 'bitsandbytes' is not supported"):
        _llm(path)
    _edit_config(path, lambda q: q.update(quant_method="gptq", group_size="many"))
    with pytest.raises(ModelLoadError, match="malformed gptq quantization_config"):
        _llm(path)
    _edit_config(path, lambda q: q.update(group_size=32))
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="'model.layers.1.mlp.down_proj.weight' lacks its 'scales'"):
        _llm(path)


def test_quantization_none_dequantizes_and_matches_too(plain_llama, tmp_path):
    path, reference = write_gptq(plain_llama, str(tmp_path / "gptq"), str(tmp_path / "reference"), 4, 64, False, True)
    llm = _llm(path, quantization="none")
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    assert max_logit_diff(llm, load_hf(reference), ids) < 1e-4
    assert all(isinstance(p, torch.Tensor) for p in (llm.llm_engine.runner.model.layers[0].qkv,))


#: MoE cases: act order as a quantizer writes it, one order for a gate and its up projection (their input's)
MOE_CASES = {
    "gptq-4bit-g32-asym-act-order": lambda p, o, r: write_gptq(p, o, r, bits=4, group=32, symmetric=False,
                                                                act_order=True, shared_order=True),
    "awq-4bit-g64": CASES["awq-4bit-g64"],
}  # fmt: skip


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_a_quantized_moe_checkpoint_matches_hf(case, hf_tokenizer_dir, tmp_path, monkeypatch):
    """A tiny Qwen3-MoE whose experts (per expert, as the quantizers write them) are GPTQ or AWQ: the experts
    reach the backend quantized, not dequantized by the loader, and the logits match HF's on the weights the
    checkpoint stands for. (Gate and up projections whose act orders differ would not stack as one quantized
    weight and would reach it dense.)"""
    from engine.interfaces.gemm import QuantizedWeight
    from engine_plugin_cpu.gemm import CpuGemmBackend

    plain = save_tiny("Qwen3MoeForCausalLM", str(tmp_path / "plain"), hf_tokenizer_dir, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)  # fmt: skip
    path, reference = MOE_CASES[case](plain, str(tmp_path / "quantized"), str(tmp_path / "reference"))
    seen = []
    original = CpuGemmBackend.prepare_experts

    def recording(self, gate_up, down, *args):
        seen.extend(gate_up + down)
        return original(self, gate_up, down, *args)

    monkeypatch.setattr(CpuGemmBackend, "prepare_experts", recording)
    llm = _llm(path)
    assert len(seen) == 2 * 2 * 4 and all(isinstance(w, QuantizedWeight) and w.scheme == "int4_grouped" for w in seen)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    assert max_logit_diff(llm, load_hf(reference), ids) < 1e-4
    assert_all_blocks_free(llm)

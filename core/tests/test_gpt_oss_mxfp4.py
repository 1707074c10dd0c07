"""gpt-oss's released checkpoint format: MXFP4 experts (``_blocks`` / ``_scales``), dequantized at load.

The references are transformers' own: its MXFP4 unpacking for the format, and its dequantizing load of the
same checkpoint for the model's outputs.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from dense_model_utils import PROMPTS, hf_greedy, max_logit_diff, save_tiny
from safetensors.torch import load_file, save_file
from test_dense_models import ARCHITECTURES

from engine import LLM, SamplingParams
from engine.loader.mxfp4 import FP4_E2M1_VALUES, MXFP4_BLOCK, dequantize_mxfp4
from engine_test_utils import assert_all_blocks_free

#: what the released checkpoints keep unquantized
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``[..., rows, in]`` to MXFP4 as a checkpoint holds it: each 32 values' scale is the smallest
    power of two that brings their largest magnitude within 6, each value the nearest E2M1 code.

    Returns:
        uint8 blocks ``[..., rows, in / 32, 16]`` (low nibble first) and scales ``[..., rows, in / 32]``.
    """
    groups = weight.float().unflatten(-1, (-1, MXFP4_BLOCK))
    peak = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(FP4_E2M1_VALUES)).abs().argmin(dim=-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponents + 127).to(torch.uint8)


def to_mxfp4_checkpoint(plain: str, out: str) -> str:
    """Copy a gpt-oss folder with its stacked experts stored as MXFP4, as the released models are."""
    os.makedirs(out, exist_ok=True)
    tensors = {}
    for name, tensor in load_file(os.path.join(plain, "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # the blocks are [experts, out, in]: the stacked tensors' transpose
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2))
        else:
            tensors[name] = tensor
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(plain):
        if name not in ("model.safetensors", "config.json"):
            with open(os.path.join(plain, name), "rb") as src, open(os.path.join(out, name), "wb") as dst:
                dst.write(src.read())
    with open(os.path.join(plain, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def test_dequantize_mxfp4_matches_transformers_unpacking():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(11)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 5, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    assert ours.shape == (3, 5, 128)
    # transformers returns the stacked layout [experts, in, out]
    torch.testing.assert_close(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), rtol=0, atol=0)


def test_dequantize_mxfp4_refuses_mismatched_scales():
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), torch.float32)


def test_an_mxfp4_checkpoint_matches_transformers_dequantized_load(tmp_path, hf_tokenizer_dir):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    plain = save_tiny("GptOssForCausalLM", str(tmp_path / "plain"), hf_tokenizer_dir, **ARCHITECTURES["GptOssForCausalLM"])
    path = to_mxfp4_checkpoint(plain, str(tmp_path / "mxfp4"))
    hf = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    llm = LLM(model=path, device="cpu", dtype="float32", quantization="none", kv_cache_memory_bytes=16 << 20)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    assert max_logit_diff(llm, hf, ids) < 1e-4
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(PROMPTS[:3], llm.generate(PROMPTS[:3], params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(hf, llm.tokenizer.encode(prompt), 6), prompt
    assert_all_blocks_free(llm)

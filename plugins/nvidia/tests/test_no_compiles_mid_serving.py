"""After start-up (decode graphs and the warm-up), serving compiles no Triton kernel: every variant a step
can need was built before the first request. GPU only: the interpreter compiles nothing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine_plugin_sdk.gpu.triton_kernels.variants import (
    compiled_variant_keys,
    compiled_variants,
    new_variant_keys,
)
from engine_plugin_sdk.testing import VOCAB, build_tiny_llama

HAS_GPU = torch.version.cuda is not None and torch.cuda.device_count() > 0
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU (Triton compiles nothing in the interpreter)")


@requires_gpu
def test_prefill_kernel_compiles_once_for_any_block_table(device: torch.device) -> None:
    from engine_plugin_nvidia.tuning import tuning_for_device
    from engine_plugin_sdk.gpu.triton_kernels.launchers import paged_prefill

    tuning = tuning_for_device(interpret=False)
    heads, kv_heads, dim, bs = 4, 2, 64, 16
    cache = torch.randn(2, 64, bs, kv_heads, dim, device=device, dtype=torch.float16)
    before = None
    # block-table widths of every divisibility class, and slices at offsets of every alignment
    for width, offset in [(1, 0), (3, 1), (16, 2), (17, 3), (32, 0), (33, 1)]:
        seqs = offset + 2
        seq_lens = torch.full((seqs,), width * bs - 3, dtype=torch.int32, device=device)
        # the batch's two sequences start at row `offset` of each tensor: slices at misaligned addresses
        query_start = torch.tensor([0] * offset + [0, 5, 10], dtype=torch.int32, device=device)
        tables = torch.randint(0, 64, (seqs, width), dtype=torch.int32, device=device)
        query = torch.randn(10, heads, dim, device=device, dtype=torch.float16)
        out = torch.empty_like(query)
        paged_prefill(
            out, query, cache, tables[offset:], seq_lens[offset:], query_start[offset:], 5, dim**-0.5, tuning,
        )  # fmt: skip
        torch.cuda.synchronize()
        now = compiled_variants()["paged_prefill_kernel"]
        before = now if before is None else before
        assert now == before, f"width {width}, offset {offset} compiled a new variant"


@requires_gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_serving_compiles_nothing_after_start_up(tmp_path: Path, kv_cache_dtype: str) -> None:
    # over an FP8 cache the decode kernel also takes two KV heads a program for large batches: with four KV
    # heads, eager mixed steps lead with one-head programs for some decode counts and paired ones for more
    build_tiny_llama(tmp_path, head_dim=128, num_heads=8, num_kv_heads=4)
    llm = LLM(
        model=str(tmp_path), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
        max_num_seqs=256, max_num_batched_tokens=512, max_model_len=256, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    ready = compiled_variant_keys()
    rng = random.Random(0)
    # prompts of every length class, chunked prefills next to hundreds of decodes, finishing at
    # staggered steps: block-table widths and batch offsets of every kind
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 120))] for _ in range(200)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 60), ignore_eos=True) for _ in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    new = new_variant_keys(ready, compiled_variant_keys())
    assert not new, f"kernels compiled after start-up: {new}"


@requires_gpu
def test_moe_serving_compiles_nothing_after_start_up(tmp_path: Path) -> None:
    # a mixture of experts picks its kernels by the step's token-expert pairs (a GEMV for few, a grouped GEMM
    # with tiles by their count for more): prompt steps from a few tokens to past 1,024 pairs
    from dense_model_utils import save_tiny_with_a_llama_tokenizer

    path = save_tiny_with_a_llama_tokenizer(
        "Qwen3MoeForCausalLM", str(tmp_path), vocab_size=VOCAB, num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, hidden_size=256,
    )  # fmt: skip
    llm = LLM(
        model=path, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20, max_num_seqs=64,
        max_num_batched_tokens=2048, max_model_len=256,
    )  # fmt: skip
    ready = compiled_variant_keys()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 200))] for _ in range(120)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True) for _ in prompts]
    # alone, then all at once: steps of one short prompt and of many tokens beside decodes
    for one in prompts[:3]:
        llm.generate([one], params[0], use_tqdm=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    new = new_variant_keys(ready, compiled_variant_keys())
    assert not new, f"kernels compiled after start-up: {new}"


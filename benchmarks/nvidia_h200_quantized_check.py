"""``nvidia_h200_quantized.py check``: a tiny GPTQ W4A16 checkpoint and a tiny GGUF (Q4_K, lm_head Q6_K) on
``cuda``, greedy tokens and prefill logits of the packed weights against the same checkpoint dequantized at
load (``quantization="none"``), in float32 (must agree) and bf16 (reported); ``--device cpu`` runs the same
logic in Triton's interpreter, float32 only (a smoke test); ``--grouped-tiles`` runs it with those fields of the
H200's ``GroupedIntTiles`` (``six_bit_codes=1``: the Q6_K LM head in 6 bits)."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any


def cmd_check(args: argparse.Namespace) -> dict[str, Any]:
    interpret = args.device == "cpu"
    if interpret:
        # the NVIDIA platform on the CPU: Triton's interpreter, set before any kernel module is imported
        os.environ.update({"ENGINE_NVIDIA_INTERPRET": "1", "TRITON_INTERPRET": "1"})
    from dense_model_utils import engine_prefill_logits, save_tiny
    from gguf_test_models import write_tiny_llama_gguf
    from nvidia_h200 import release
    from nvidia_h200_dense import tokenizer_only
    from nvidia_h200_quantized import grouped_tiles, tile_overrides
    from prequantized_checkpoints import write_gptq

    from engine import LLM, SamplingParams
    from engine_plugin_sdk.gpu.gemm import GroupedIntWeight

    prompts = [[5, 17, 300, 42, 7], [100, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [511, 0, 256, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=3 if interpret else 12, ignore_eos=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tok = tokenizer_only(args.tokenizer, os.path.join(tmp, "tokenizer"))
        plain = save_tiny("LlamaForCausalLM", os.path.join(tmp, "plain"), tok, vocab_size=512, hidden_size=256,
                          intermediate_size=512, head_dim=64)  # fmt: skip
        gptq, _ = write_gptq(plain, os.path.join(tmp, "gptq"), os.path.join(tmp, "gptq-ref"), bits=4, group=128,
                             symmetric=True, act_order=False)  # fmt: skip
        gguf_path = os.path.join(tmp, "tiny-q4_k.gguf")
        write_tiny_llama_gguf(Path(gguf_path))  # Q4_K matrices, Q6_K lm_head, 512 tokens
        cases = {"gptq_w4a16": (gptq, {}), "gguf_q4_k": (gguf_path, {"tokenizer": tok})}
        for case, (model, extra) in cases.items():
            for dtype in ["float32"] if interpret else ["float32", "bfloat16"]:
                runs = {}
                for quantization in ("auto", "none"):
                    with grouped_tiles(tile_overrides(args.grouped_tiles) if args.grouped_tiles else {}):
                        llm = LLM(model=model, device="cuda", dtype=dtype, quantization=quantization,
                                  max_model_len=256, kv_cache_memory_bytes=64 << 20, **extra)  # fmt: skip
                    layer = llm.llm_engine.model.layers[0]
                    packed = sum(isinstance(getattr(layer, f), GroupedIntWeight) for f in ("qkv", "o_proj", "gate_up", "down"))
                    if args.one_at_a_time:
                        # each prompt alone: batch-1 decode steps, the GEMVs (their gated epilogue on gate/up)
                        tokens = [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
                                  for p in prompts]  # fmt: skip
                    else:
                        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
                    runs[quantization] = (tokens, engine_prefill_logits(llm, prompts).float().cpu(), packed)
                    del llm
                    release()
                (got, got_logits, packed), (want, want_logits, dense) = runs["auto"], runs["none"]
                equal = sum(a == b for a, b in zip(got, want, strict=True))
                diff = float((got_logits - want_logits).abs().max())
                ok = packed == 4 and dense == 0 and (dtype != "float32" or (equal == len(prompts) and diff < 1e-3))
                results[f"{case}_{dtype}"] = {"greedy_equal": f"{equal}/{len(prompts)}", "max_logit_diff": diff,
                                              "packed_projections": packed, "ok": ok}  # fmt: skip
                print(f"{case:11s} {dtype:9s} packed projections {packed}/4 (dequantized run {dense}/4)  greedy equal "
                      f"{equal}/{len(prompts)}  max prefill logit diff {diff:.2e}  {'ok' if ok else 'FAILED'}", flush=True)  # fmt: skip
    results["ok"] = all(v["ok"] for v in results.values() if isinstance(v, dict))
    return results

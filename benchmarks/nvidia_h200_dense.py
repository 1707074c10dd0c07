"""The dense architectures on the H200: greedy tokens against HF transformers, and batch-1 decode roofline.

Two subcommands, for the dense-model issue's GPU checks:

- ``greedy``: every architecture of ``core/tests/test_dense_models.py`` as a tiny seeded checkpoint (head
  size 64, which the GPU kernels run), the engine on ``cuda`` in float32 (``--dtype``) against HF transformers in float32:
  greedy tokens of the five test prompts in one batch, and the largest prefill-logit difference.
- ``decode``: config-only Qwen3-8B- and Gemma-2-9B-shaped folders with dummy bf16 weights; batch-1 decode
  with CUDA graphs against the roofline of the bytes a step reads (every weight but the embedding table,
  plus the LM head), at the copy bandwidth measured in the same run.

Usage (repository root, on the device machine after ``source benchmarks/nvidia_h200_setup.sh``)::

    python benchmarks/nvidia_h200_dense.py greedy --tokenizer .nvcarry/llama3-8b-dummy
    python benchmarks/nvidia_h200_dense.py decode --tokenizer .nvcarry/llama3-8b-dummy --json decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "core" / "tests"), str(ROOT / "benchmarks")]

#: HF config.json of the decode shapes (the published models' sizes)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 12288, "vocab_size": 151936, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    "gemma2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
        "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "intermediate_size": 14336, "vocab_size": 256000, "rope_theta": 10000.0,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": 2, "eos_token_id": 1, "torch_dtype": "bfloat16",
    },
}  # fmt: skip


def tokenizer_only(folder: str, out: str) -> str:
    """Copy a model folder's tokenizer files (not its config or weights) into ``out``."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(folder):
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(os.path.join(folder, name), out)
    return out


def cmd_greedy(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from dense_model_utils import PROMPTS, hf_greedy, load_hf, max_logit_diff, save_tiny
    from test_dense_models import ARCHITECTURES

    from engine import LLM, SamplingParams

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tok = tokenizer_only(args.tokenizer, os.path.join(tmp, "tokenizer"))
        for case, overrides in ARCHITECTURES.items():
            if args.only and case not in args.only:
                continue
            arch = case.split("-")[0]  # a case may be a variant of an architecture ("...-parallel")
            folder = save_tiny(arch, os.path.join(tmp, case), tok, **{"hidden_size": 256, "head_dim": args.head_dim, **overrides})
            llm = LLM(model=folder, device="cuda", dtype=args.dtype, max_model_len=256, kv_cache_memory_bytes=1 << 30)
            hf = load_hf(folder)
            ids = [llm.llm_engine.tokenizer.encode(p) for p in PROMPTS]
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            if args.one_at_a_time:  # batch-1 steps: the single-row GEMVs inside the decode graphs
                outs = [llm.generate([i], params, use_tqdm=False)[0] for i in ids]
            else:
                outs = llm.generate(ids, params, use_tqdm=False)
            equal = sum(list(o.outputs[0].token_ids) == hf_greedy(hf, p, 8) for o, p in zip(outs, ids, strict=True))
            diff = max_logit_diff(llm, hf, ids)
            results[case] = {"greedy_equal": f"{equal}/{len(ids)}", "max_logit_diff": diff}
            print(f"{case:30s} greedy equal {equal}/{len(ids)}  max prefill logit diff {diff:.2e}", flush=True)
            del llm, hf
            torch.cuda.empty_cache()
    return results


def cmd_decode(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch
    from nvidia_h200 import copy_bandwidth, decode_rate, weight_bytes

    from engine import LLM

    bandwidth = copy_bandwidth()
    results: dict[str, Any] = {"copy_bandwidth_TBps": bandwidth / 1e12}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            folder = tokenizer_only(args.tokenizer, os.path.join(tmp, name))
            Path(folder, "config.json").write_text(json.dumps(SHAPES[name]), encoding="utf-8")
            llm = LLM(model=folder, device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=8,
                      kv_cache_memory_bytes=8 << 30, max_model_len=4096)  # fmt: skip
            _, read = weight_bytes(llm)
            rate = decode_rate(llm)
            roofline = bandwidth / read
            results[name] = {"GB_read_per_step": read / 1e9, "roofline_tok_s": roofline, "decode_tok_s": rate,
                             "ratio_to_roofline": rate / roofline}  # fmt: skip
            print(f"{name:10s} reads {read / 1e9:.2f} GB/step  roofline {roofline:.1f} tok/s  decode {rate:.1f} tok/s"
                  f"  = {rate / roofline:.3f} of it", flush=True)  # fmt: skip
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("greedy", "decode"):
        p = sub.add_parser(name)
        p.add_argument("--tokenizer", required=True, help="a folder holding a HF tokenizer (its other files are ignored)")
        p.add_argument("--json", default=None)
        if name == "greedy":
            p.add_argument("--only", nargs="*", default=None, help="test cases to run (default: all)")
            p.add_argument("--dtype", default="float32",
                           help="the engine's dtype (HF runs float32); bfloat16 takes the batch-1 GEMVs")
            p.add_argument("--one-at-a-time", action="store_true", help="each prompt alone (batch-1 decode)")
            p.add_argument("--head-dim", type=int, default=64,
                           help="the tiny models' head size (above 128 takes the large-head decode tiles)")
        if name == "decode":
            p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    result = {"greedy": cmd_greedy, "decode": cmd_decode}[args.command](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()

"""Offline throughput of the engine against Hugging Face transformers `generate`, measured in one run.

The workload of the core-engine issue: N prompts of about P tokens, O output tokens each (greedy, EOS ignored),
on the embedded SmolLM2-135M-Instruct GGUF. HF runs the same prompts in batches of --hf-batch with left padding.

    python benchmarks/offline_vs_hf.py --num-prompts 64 --prompt-len 100 --output-len 128 --hf-batch 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch


def make_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = "the of and to in is was for on that with as by at from his her an were are which this be".split()
    prompts = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(length * 2))
        prompts.append(tokenizer.encode(text)[:length])
    return prompts


def run_engine(prompts: list[list[int]], output_len: int, dtype: str, quantization: str) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(device="cpu", dtype=dtype, quantization=quantization, kv_cache_memory_bytes=2 << 30)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return generated / elapsed


def run_hf(prompts: list[list[int]], output_len: int, batch: int, gguf: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    ).eval()
    pad = 2
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                do_sample=False, pad_token_id=pad,
            )
        generated += (out.shape[1] - width) * len(chunk)
    return generated / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--settings", nargs="*", default=["float32:none", "auto:auto"],
                    help="engine settings to measure, each DTYPE:QUANTIZATION")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()

    from engine.loader import default_model_path, load_tokenizer

    gguf = default_model_path()
    tok = load_tokenizer(gguf)
    prompts = make_prompts(tok, args.num_prompts, args.prompt_len, seed=0)
    result: dict[str, float] = {"threads": torch.get_num_threads(), "load_average_1m": os.getloadavg()[0]}
    for setting in args.settings:
        dtype, quantization = setting.split(":")
        result[f"engine_{setting}_output_tok_s"] = round(run_engine(prompts, args.output_len, dtype, quantization), 1)
    if not args.skip_hf:
        hf_tps = run_hf(prompts, args.output_len, args.hf_batch, gguf)
        result["hf_output_tok_s"] = round(hf_tps, 1)
        for setting in args.settings:
            result[f"ratio_{setting}"] = round(result[f"engine_{setting}_output_tok_s"] / hf_tps, 2)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

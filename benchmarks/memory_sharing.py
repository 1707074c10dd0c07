"""KV-cache benchmarks of the memory-sharing issue, each measured in one run on the embedded model.

    python benchmarks/memory_sharing.py waste      # fraction of allocated KV slots holding no token
    python benchmarks/memory_sharing.py prefix     # shared 1,000-token system prompt, caching on vs off
    python benchmarks/memory_sharing.py chunked    # decode ITL p99 while a 4,000-token prompt arrives
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine import LLM, SamplingParams


def words(rng: random.Random, n: int) -> str:
    vocab = "alpha beta gamma delta river mountain city ocean forest engine paper light stone music".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def bench_waste(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    llm = LLM(device="cpu", dtype=args.dtype, kv_cache_memory_bytes=256 << 20, max_num_seqs=64)
    engine = llm.llm_engine
    bs = engine.block_manager.block_size
    lengths = []
    for i in range(args.num_requests):
        prompt_len, out_len = rng.randint(8, 400), rng.randint(4, 64)
        ids = engine.tokenizer.encode(words(rng, prompt_len * 2))[:prompt_len]
        engine.add_request(f"w{i}", ids, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True))
        lengths.append(prompt_len + out_len)
    allocated_slots = used_slots = 0
    while engine.has_unfinished_requests():
        engine.step()
        seqs = engine.scheduler.running
        allocated_slots += sum(len(engine.block_manager.block_tables.get(s.seq_id, ())) for s in seqs) * bs
        used_slots += sum(s.num_computed_tokens for s in seqs)
    waste = 1 - used_slots / allocated_slots
    # How many sequences of this workload fit one budget: contiguous reservation of max_model_len each vs
    # paged blocks sized to what each sequence actually holds on average.
    budget_tokens = 64 * 2048
    contiguous = budget_tokens // 2048
    mean_blocks = statistics.mean(-(-n // bs) for n in lengths)
    paged = int(budget_tokens // (mean_blocks * bs))
    return {
        "kv_waste_fraction": round(waste, 4),
        "block_size": bs,
        "budget_tokens": budget_tokens,
        "seqs_fit_contiguous_max_len_2048": contiguous,
        "seqs_fit_paged": paged,
    }


def bench_prefix(args: argparse.Namespace) -> dict:
    rng = random.Random(1)
    system = words(rng, 1400)
    result = {}
    for caching in (True, False):
        llm = LLM(device="cpu", dtype=args.dtype, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=caching)
        tok = llm.tokenizer
        sys_ids = tok.encode(system)[:1000]
        prompts = [sys_ids + tok.encode(" Question: " + words(rng, 60))[:50] for _ in range(args.num_requests)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        engine = llm.llm_engine
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"p{i}", p, params)
        first: dict[str, float] = {}
        generated = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter() - start
                first.setdefault(out.request_id, now)
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
        elapsed = time.perf_counter() - start
        key = "on" if caching else "off"
        result[key] = {
            "output_tok_s": round(generated / elapsed, 1),
            "mean_ttft_s": round(statistics.mean(first.values()), 2),
            "hit_rate": engine.stats()["prefix_cache_hit_rate"],
        }
        del llm, engine
    result["throughput_ratio"] = round(result["on"]["output_tok_s"] / result["off"]["output_tok_s"], 2)
    return result


def bench_chunked(args: argparse.Namespace) -> dict:
    rng = random.Random(2)
    result = {}
    for label, budget in (("chunked_512", 512), ("unchunked", 8192)):
        llm = LLM(device="cpu", dtype=args.dtype, kv_cache_memory_bytes=1 << 30, max_num_batched_tokens=budget,
                  enable_prefix_caching=False)
        engine = llm.llm_engine
        tok = llm.tokenizer
        for i in range(8):
            engine.add_request(f"d{i}", tok.encode(words(rng, 40)), SamplingParams(max_tokens=10_000 // 100, temperature=0.0, ignore_eos=True))
        for _ in range(5):
            engine.step()
        long_ids = tok.encode(words(rng, 6000))[:4000]
        engine.add_request("long", long_ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        # Every decode just produced a token: the first gap measured is the one the long prompt causes.
        now = time.perf_counter()
        last: dict[str, float] = {f"d{i}": now for i in range(8)}
        gaps: list[float] = []
        while "long" in engine.requests:
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.request_id.startswith("d"):
                    if out.request_id in last:
                        gaps.append(now - last[out.request_id])
                    last[out.request_id] = now
        engine.abort_request([f"d{i}" for i in range(8)])
        gaps.sort()
        result[label] = {
            "decode_itl_p50_ms": round(1000 * gaps[len(gaps) // 2], 1),
            "decode_itl_p99_ms": round(1000 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))], 1),
            "decode_itl_max_ms": round(1000 * gaps[-1], 1),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["waste", "prefix", "chunked"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    args = ap.parse_args()
    fn = {"waste": bench_waste, "prefix": bench_prefix, "chunked": bench_chunked}[args.which]
    print(json.dumps({args.which: fn(args)}, indent=2))


if __name__ == "__main__":
    main()

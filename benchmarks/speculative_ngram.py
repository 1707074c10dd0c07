"""n-gram, suffix and draft-model speculative decoding on the CPU with the embedded model
(SmolLM2-135M-Instruct, its default packed bf16 path): copy-heavy requests (rewrite a given text, 256
tokens) at batch 1, and the throughput cost at batch 64 on requests whose outputs share little with their
prompts; plain and the methods one after the other in one run.

``draft`` drafts with ``--draft`` (default: the target's own file, which only checks the plumbing: every
proposal is accepted); point it at a smaller model of the target's family.

    python benchmarks/speculative_ngram.py [--tokens 256] [--k 4] [--suffix-k 32] [--methods plain,ngram,suffix] [--rounds 3]
    python benchmarks/speculative_ngram.py --model BIG --methods plain,draft --draft SMALL
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

PASSAGE = (
    "The quick brown fox jumps over the lazy dog near the river bank. Every morning the fox runs along "
    "the path, looks at the water, and returns to its den before the sun is high. The dog, who sleeps "
    "under the old oak tree, never wakes up in time to see it."
)
MORE = (
    "In the afternoon the farmer walks to the market with a basket of apples, pears and plums. He sells "
    "them to the baker, the teacher and the doctor, and counts his coins twice on the way home. At night "
    "he writes the numbers in a small blue book that he keeps on the shelf above the fireplace. When the "
    "winter comes, he reads the book again and plans which trees to plant in the spring, and where."
)
LAKE = (
    "On Saturdays the children of the village carry a wooden boat down to the lake and race it against the "
    "wind. The youngest girl paints a new number on its sail each week, and the oldest boy keeps the rope "
    "tied to his wrist so that the boat never drifts too far. When the race is over they sit on the warm "
    "stones, share bread and cheese, and argue about who steered best."
)
EVENING = (
    "In the evening the baker closes his shop, sweeps the flour from the floor and sets the dough for the "
    "next morning. The teacher walks home past the bakery and always stops to buy one small loaf. The "
    "doctor, who works late, finds the last loaf waiting for him on the counter with a note that says "
    "thank you, and he eats it slowly on the bench outside while the street lamps come on one by one."
)
#: a text longer than the output and with no paragraph twice (a repeated one was copied once, and the
#: model then went on with text of its own), so that every generated token is a copy (about 300 tokens)
COPY_PROMPT = f"Repeat the following text exactly, word for word:\n\n{PASSAGE} {MORE} {LAKE} {EVENING}"
QUESTIONS = [f"Write a short story about a robot who learns to paint, number {i}." for i in range(64)]


def run(llm, prompts: list[str], tokens: int) -> tuple[float, int]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=4, help="ngram's num_speculative_tokens")
    parser.add_argument("--suffix-k", type=int, default=32, help="suffix's num_speculative_tokens (its default)")
    parser.add_argument("--methods", default="plain,ngram,suffix", help="comma-separated, plain first")
    parser.add_argument("--model", default=None, help="the target (default: the embedded GGUF); also the draft's file")
    parser.add_argument("--device", default=None, help="the best available when not given")
    parser.add_argument("--draft", default=None, help="the draft model of method draft (default: the target)")
    parser.add_argument("--quantization", default="auto", help="the target's")
    parser.add_argument("--dtype", default="auto", help="the target's and the draft's")
    parser.add_argument("--no-auto-disable", action="store_true", help="keep proposing whatever it costs")
    parser.add_argument("--rounds", type=int, default=3, help="batch-1 runs of each method, in turn")
    parser.add_argument("--out", default="benchmarks/results/speculative_ngram_cpu.json")
    args = parser.parse_args()
    from engine import LLM
    from engine.loader.paths import default_model_path

    configs = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        "suffix": {"method": "suffix", "num_speculative_tokens": args.suffix_k},
        "draft": {"model": args.draft or args.model or default_model_path(), "num_speculative_tokens": args.k},
    }
    if args.no_auto_disable:
        configs = {k: v if v is None else {**v, "auto_disable": False} for k, v in configs.items()}
    methods = args.methods.split(",")
    report: dict = {
        "cpu": platform.processor() or platform.machine(), "tokens": args.tokens, "k": args.k, "suffix_k": args.suffix_k,
        "quantization": args.quantization, "dtype": args.dtype,
    }  # fmt: skip
    llms = {}
    for name in methods:
        llm = LLM(
            args.model, kv_cache_memory_bytes=256 << 20, speculative_config=configs[name],
            quantization=args.quantization, dtype=args.dtype, **({"device": args.device} if args.device else {}),
        )  # fmt: skip
        # warm-up: the kernels of every shape, and the speculation switch's first measurements of both
        # workloads (it keeps measuring while serving; a server spends its time in that steady state)
        run(llm, [COPY_PROMPT], args.tokens // 2)
        run(llm, QUESTIONS, 32)
        llms[name] = llm
    # batch 1 in rounds, the methods in turn within each (all engines loaded): a machine's rate drifts
    # within a run, and a ratio of medians taken side by side carries less of that drift
    rates: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            speculator = llm.llm_engine.speculator
            if speculator is not None and speculator.cache is not None:
                # earlier runs' output would hand suffix decoding the measured run's tokens
                speculator.cache.clear()
            before = _spec_stats(llm)
            seconds, produced = run(llm, [COPY_PROMPT], args.tokens)
            rates[name].append(round(produced / seconds, 1))
            if configs[name] is not None:
                report[f"{name}_batch1_stats"] = _stats_since(before, _spec_stats(llm))
    for name, llm in llms.items():
        report[f"{name}_batch1_tok_s"] = statistics.median(rates[name])
        report[f"{name}_batch1_rounds"] = rates[name]
        before = _spec_stats(llm)
        seconds, produced = run(llm, QUESTIONS, 64)
        report[f"{name}_batch64_tok_s"] = round(produced / seconds, 1)
        if configs[name] is not None:
            report[f"{name}_stats"] = _stats_since(before, _spec_stats(llm))
        llm.shutdown()
    for name in methods:
        if name != "plain" and "plain" in methods:
            report[f"{name}_batch1_speedup"] = round(report[f"{name}_batch1_tok_s"] / report["plain_batch1_tok_s"], 2)
            report[f"{name}_batch1_round_speedups"] = [
                round(a / b, 2) for a, b in zip(rates[name], rates["plain"], strict=True)
            ]
            report[f"{name}_batch64_ratio"] = round(report[f"{name}_batch64_tok_s"] / report["plain_batch64_tok_s"], 2)
    print(json.dumps(report, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


def _spec_stats(llm) -> dict:
    """The acceptance counters so far (cumulative over the engine's runs)."""
    return {k: v for k, v in llm.llm_engine.stats().items() if k.startswith("spec_")}


def _stats_since(before: dict, after: dict) -> dict:
    """One run's acceptance: the counters' growth, and the rates they give."""
    grown = {k: after[k] - before[k] for k in ("spec_num_proposed_tokens", "spec_num_accepted_tokens", "spec_num_verified_steps", "spec_steps_switched_off")}
    proposed, accepted, steps = grown["spec_num_proposed_tokens"], grown["spec_num_accepted_tokens"], grown["spec_num_verified_steps"]
    grown["spec_acceptance_rate"] = round(accepted / proposed, 4) if proposed else 0.0
    grown["spec_mean_accepted_length"] = round((accepted + steps) / steps, 4) if steps else 0.0
    return grown


if __name__ == "__main__":
    main()

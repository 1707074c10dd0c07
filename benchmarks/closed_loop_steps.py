"""Closed-loop load without HTTP: ``--clients`` requests kept in flight on one ``LLMEngine``, each finished
request replaced by a new one after a client's turnaround (``--turnaround-ms``, drawn uniformly), as
``engine bench serve --concurrency N`` does through the server, so that the steps mix prefill chunks and
decodes as serving does while the server's event loop is out of the picture. Runs once per
``--delay-factor`` (``scheduler_delay_factor``) on the same engine and prints output tok/s and the steps'
count and mean wall time, those that return first tokens apart.

    python benchmarks/closed_loop_steps.py --model .nvcarry/llama3-8b-dummy --device cuda --load-format dummy \\
        --dtype bfloat16 --delay-factor 0 1 4
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any


def build(args: argparse.Namespace) -> Any:
    from engine.llm import LLM

    kwargs: dict[str, Any] = dict(
        model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.clients, max_model_len=2048,
    )
    if args.load_format:
        kwargs["load_format"] = args.load_format
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    return LLM(**kwargs).llm_engine


def run(args: argparse.Namespace, engine: Any, delay_factor: float) -> dict[str, Any]:
    from engine.sampling.params import SamplingParams

    engine.scheduler.config.scheduler_delay_factor = delay_factor
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    total = args.clients * args.requests_per_client
    added = produced = 0
    due: list[float] = []  # when each finished client sends its next request

    def add() -> None:
        nonlocal added
        engine.add_request(f"d{delay_factor}-r{added}", [rng.randint(1000, 40000) for _ in range(args.input_len)], params)
        added += 1

    compiled = _compiled_variants()
    for _ in range(args.clients):
        add()
    firsts = 0
    first_wave_s = None
    kinds: dict[str, list[float]] = {"decode": [], "with_first_tokens": []}
    started = last = time.perf_counter()
    lo, hi = (t / 1e3 for t in args.turnaround_ms)
    while engine.has_unfinished_requests() or due:
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(due) - time.perf_counter()))
        now = time.perf_counter()
        for when in [t for t in due if t <= now]:
            due.remove(when)
            if added < total:
                add()
        if not engine.has_unfinished_requests():
            continue
        outputs = engine.step()
        now = time.perf_counter()
        num_first = sum(len(o.outputs[0].token_ids) == 1 for o in outputs)
        first = num_first > 0
        firsts += num_first
        if first_wave_s is None and firsts >= args.clients:
            first_wave_s = now - started
        kinds["with_first_tokens" if first else "decode"].append(now - last)
        last = now
        for out in outputs:
            if out.finished:
                produced += len(out.outputs[0].token_ids)
                due.append(now + rng.uniform(lo, hi))
    seconds = time.perf_counter() - started
    return {
        "clients": args.clients, "delay_factor": delay_factor, "requests": total, "seconds": seconds,
        "output_tok_s": produced / seconds,
        # when the last of the first `clients` requests (sent at once) had its first token: the burst's TTFT
        "first_wave_s": first_wave_s,
        "kernels_compiled_during_run": _new_variants(compiled, _compiled_variants()) or "none",
        "steps": {k: {"count": len(v), "mean_ms": 1e3 * sum(v) / max(1, len(v))} for k, v in kinds.items()},
    }


def _compiled_variants() -> dict[str, int] | None:
    try:
        from engine_plugin_sdk.gpu.triton_kernels.variants import compiled_variants
    except ImportError:  # no Triton here: nothing compiles
        return None
    return compiled_variants()


def _new_variants(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    from engine_plugin_sdk.gpu.triton_kernels.variants import new_variants

    return new_variants(before, after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--turnaround-ms", type=float, nargs=2, default=[2.0, 20.0], metavar=("LO", "HI"))
    parser.add_argument("--delay-factor", type=float, nargs="+", default=[0.0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    engine = build(args)
    result = {"turnaround_ms": args.turnaround_ms, "runs": [run(args, engine, f) for f in args.delay_factor]}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

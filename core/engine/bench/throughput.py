"""``engine bench throughput``: offline generation speed through :class:`engine.LLM`, no HTTP involved."""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from engine.bench.report import format_table, to_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts to generate for (default: 32)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt (default: 64)")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this file ('-' for stdout)")


def run_from_args(args: argparse.Namespace) -> int:
    from engine.entrypoints.cli import CliError, engine_config_from_args

    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise CliError("--num-prompts, --input-len and --output-len must be positive")
    config = engine_config_from_args(args)
    metrics = measure(config, args.num_prompts, args.input_len, args.output_len, args.seed)
    rows: list[tuple[str, Any]] = [
        ("Requests", metrics["num_prompts"]),
        ("Duration (s)", metrics["duration_s"]),
        ("Request throughput (req/s)", metrics["request_throughput"]),
        ("Output token throughput (tok/s)", metrics["output_throughput"]),
        ("Total token throughput (tok/s)", metrics["total_token_throughput"]),
    ]
    print(format_table("Offline throughput", rows))
    if args.json == "-":
        print(to_json(metrics))
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(to_json(metrics) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def measure(config: Any, num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> dict[str, Any]:
    """Generate ``output_len`` tokens (EOS ignored) for ``num_prompts`` random prompts of ``input_len`` tokens."""
    from engine.entrypoints.cli import CliError, one_line
    from engine.llm import LLM
    from engine.plugins.selection import DeviceNotAvailableError
    from engine.sampling.params import SamplingParams

    extra = {**config.cache.model_dump(exclude_unset=True), **config.scheduler.model_dump(exclude_unset=True)}
    try:
        llm = LLM(model=config.model, device=config.device, dtype=config.dtype, seed=config.seed,
                  max_model_len=config.max_model_len, enforce_eager=config.enforce_eager,
                  load_format=config.load_format, **extra)
    except (DeviceNotAvailableError, ValueError, OSError) as exc:
        raise CliError(one_line(str(exc))) from None
    rng = random.Random(seed)
    vocab = llm.llm_engine.model_config.vocab_size
    # Ordinary tokens only: the low ids of most vocabularies are special or byte tokens.
    low, high = min(1000, vocab // 4), vocab - 1
    prompts = [[rng.randint(low, high) for _ in range(input_len)] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - start
    out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": num_prompts / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }

"""What prefix-cache hashing costs the host: SHA-256 over packed tokens with a content check, against
the previous 64-bit Python tuple hash, side by side.

Measured, for a 2,048-token prompt in blocks of 16:

- the hash of one block alone (old: ``hash((parent, tuple(tokens), None))``; new: pack the tokens,
  build the content, SHA-256 it; BLAKE2b is timed too, the other candidate);
- ``register_computed`` of the whole prompt (the step that finishes a prefill) and ``match_prefix`` of
  it again (a cache hit: hash, look up, compare the content);
- per decoded token: ``register_computed`` as the scheduler calls it after every decode step (one block
  in 16 becomes full), averaged over 2,048 decoded tokens;

and that last figure as a share of a batch-1 decode step (``--decode-step-ms``, 7 ms for the embedded
model on the 2-core CPU this was written on; measure yours with
``python -m engine.entrypoints.cli bench throughput --num-prompts 1 --input-len 128 --output-len 64``).

The old figures come from the previous ``block_manager.py`` when given one (its ``match_prefix`` and
``register_computed`` have the same signatures)::

    git show <commit before the change>:core/engine/block_manager.py > /tmp/old_block_manager.py
    python benchmarks/prefix_hash_cost.py --compare-with /tmp/old_block_manager.py
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import struct
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from engine import block_manager as new_block_manager

BLOCK_SIZE = 16


def best_of(fn: Callable[[], Any], repeats: int, number: int) -> float:
    """The best mean time of one call in seconds, over ``repeats`` runs of ``number`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return min(times)


def load_module(path: str) -> ModuleType:
    """Import a block_manager.py from a file, under a private name."""
    spec = importlib.util.spec_from_file_location("_compared_block_manager", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def one_block_hashes(tokens: list[int]) -> dict[str, float]:
    """Seconds to hash one full block, each way."""
    parent_int, parent_bytes = 1234567, bytes(32)
    pack = struct.Struct(f"<{BLOCK_SIZE}q").pack
    index = (3).to_bytes(8, "little")

    def sha256() -> bytes:
        return hashlib.sha256(parent_bytes + index + pack(*tokens)).digest()

    def blake2b() -> bytes:
        return hashlib.blake2b(parent_bytes + index + pack(*tokens), digest_size=32).digest()

    return {
        "python_tuple_hash": best_of(lambda: hash((parent_int, tuple(tokens), None)), 5, 20_000),
        "sha256_packed": best_of(sha256, 5, 20_000),
        "blake2b_packed": best_of(blake2b, 5, 20_000),
    }


def block_manager_costs(module: ModuleType, prompt: list[int], decode_tokens: int) -> dict[str, float]:
    """Seconds for one prompt's register and match, and per decoded token, with ``module``'s BlockManager."""
    num_blocks = 4 * (len(prompt) + decode_tokens) // BLOCK_SIZE + 8

    def register_prompt() -> None:
        bm = module.BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
        bm.allocate(0, len(prompt))
        bm.register_computed(0, lambda a, b: prompt[a:b], len(prompt))

    def register_bare() -> None:  # the same without the hashing, to subtract
        bm = module.BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
        bm.allocate(0, len(prompt))

    warm = module.BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    warm.allocate(0, len(prompt))
    warm.register_computed(0, lambda a, b: prompt[a:b], len(prompt))
    seq_ids = iter(range(1, 10**9))

    def match_prompt() -> None:
        seq_id = next(seq_ids)
        warm.match_prefix(seq_id, prompt)
        warm.free(seq_id)

    tokens = list(prompt)

    def decode_run() -> None:
        del tokens[len(prompt) :]
        bm = module.BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
        bm.allocate(0, len(tokens))
        bm.register_computed(0, lambda a, b: tokens[a:b], len(tokens))
        for step in range(decode_tokens):
            tokens.append(step % 1000)
            bm.allocate(0, len(tokens))
            bm.register_computed(0, lambda a, b: tokens[a:b], len(tokens))

    def decode_bare() -> None:  # the same loop without register_computed
        del tokens[len(prompt) :]
        bm = module.BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
        bm.allocate(0, len(tokens))
        bm.register_computed(0, lambda a, b: tokens[a:b], len(tokens))
        for step in range(decode_tokens):
            tokens.append(step % 1000)
            bm.allocate(0, len(tokens))

    bare = best_of(register_bare, 5, 50)
    decode = best_of(decode_run, 5, 3) - best_of(decode_bare, 5, 3)
    return {
        "register_prompt": best_of(register_prompt, 5, 50) - bare,
        "match_prompt_hit": best_of(match_prompt, 5, 50),
        "per_decoded_token": decode / decode_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=2048)
    parser.add_argument("--decode-step-ms", type=float, default=7.0, help="a batch-1 decode step of the model")
    parser.add_argument("--compare-with", help="a previous block_manager.py to measure side by side")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    prompt = [(7919 * i) % 49152 for i in range(args.prompt_len)]
    report: dict[str, Any] = {"prompt_len": args.prompt_len, "block_size": BLOCK_SIZE}
    report["one_block_us"] = {k: v * 1e6 for k, v in one_block_hashes(prompt[:BLOCK_SIZE]).items()}
    modules = {"new": new_block_manager}
    if args.compare_with:
        modules["old"] = load_module(args.compare_with)
    for name, module in modules.items():
        costs = block_manager_costs(module, prompt, args.decode_tokens)
        report[name] = {
            "register_prompt_us": costs["register_prompt"] * 1e6,
            "match_prompt_hit_us": costs["match_prompt_hit"] * 1e6,
            "per_decoded_token_us": costs["per_decoded_token"] * 1e6,
            "share_of_decode_step_pct": 100 * costs["per_decoded_token"] * 1e3 / args.decode_step_ms,
        }
    if "old" in report:
        report["new_minus_old_per_decoded_token_us"] = (
            report["new"]["per_decoded_token_us"] - report["old"]["per_decoded_token_us"]
        )
        report["new_minus_old_share_of_decode_step_pct"] = (
            report["new"]["share_of_decode_step_pct"] - report["old"]["share_of_decode_step_pct"]
        )
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

"""Dual-batch overlap on the H200, one decode step at a time: whole steps against two nano-batches.

A Llama-3-8B-shaped model of ``--layers`` layers (dummy bf16 weights) runs one decode step of R sequences,
each with a context of C tokens (random block tables over the KV pool), recorded in a CUDA graph as the
engine's decode graphs record it. For each (R, C) it prints the step's time whole, with the attention
calls taken out (what the products and small ops take alone), the ideal overlap (the larger of that and
the attention's share), and as two overlapped nano-batches with the products leaving each
``--attention-sms`` count of SMs to the attention lane, its stream at each ``--attention-priority``.

    python benchmarks/nvidia_h200_overlap.py --tokenizer .nvcarry/llama3-8b-dummy --rows 256 512 1024 \\
        --contexts 640 2048 --attention-sms 0 16 32
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

BLOCK_SIZE = 16


def model_folder(tokenizer: str, out: str, layers: int) -> str:
    """The dummy folder's config with ``layers`` layers, and its tokenizer files."""
    from nvidia_h200_dense import tokenizer_only

    config = json.loads(Path(tokenizer, "config.json").read_text(encoding="utf-8"))
    config["num_hidden_layers"] = layers
    folder = tokenizer_only(tokenizer, out)
    Path(folder, "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def decode_step(model: Any, caches: list[Any], rows: int, ctx: int) -> tuple[Any, ...]:
    """A recorded decode step's inputs: ``rows`` sequences of ``ctx`` tokens over random blocks."""
    from engine.interfaces.attention import AttentionMetadata

    dev = caches[0].device
    num_blocks = caches[0].shape[1]
    per_seq = math.ceil(ctx / BLOCK_SIZE)
    tables = torch.randint(0, num_blocks, (rows, per_seq), device=dev, dtype=torch.int32)
    slots = tables[:, -1].long() * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE
    meta = AttentionMetadata(
        query_start_loc=torch.arange(rows + 1, device=dev, dtype=torch.int32),
        seq_lens=torch.full((rows,), ctx, device=dev, dtype=torch.int32),
        block_tables=tables, slot_mapping=slots, query_lens_cpu=[1] * rows, seq_lens_cpu=[ctx] * rows,
        max_query_len=1, max_seq_len=ctx, block_size=BLOCK_SIZE, scale=model.scale, graph_capture=True,
    )  # fmt: skip
    ids = torch.randint(0, model.config.vocab_size, (rows,), device=dev)
    positions = torch.full((rows,), ctx - 1, device=dev)
    return ids, positions, caches, meta


def without_attention(model: Any) -> Any:
    """Make the model's attention calls return their query (no kernel); returns the undo."""
    backend = model.attention
    saved = backend.forward, backend.forward_rotary
    backend.forward = lambda q, k, v, cache, meta: q
    backend.forward_rotary = lambda q, k, v, cache, meta, rotary: q

    def undo() -> None:
        backend.forward, backend.forward_rotary = saved

    return undo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True, help="the Llama-3-8B dummy folder (config and tokenizer)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--contexts", type=int, nargs="+", default=[640, 2048])
    parser.add_argument("--attention-sms", type=int, nargs="+", default=[0, 16, 32])
    parser.add_argument("--attention-priority", type=int, nargs="+", default=[0, -1],
                        help="the attention stream's priorities to try (negative: higher than the products')")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--quantization", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from nvidia_h200 import make_llm
    from nvidia_h200_moe import timed

    from engine_plugin_sdk.gpu.step_overlap import TorchStreamStepOverlap

    result: dict[str, Any] = {"layers": args.layers, "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization}
    with tempfile.TemporaryDirectory() as tmp:
        llm = make_llm(
            model_folder(args.tokenizer, tmp, args.layers), enforce_eager=True, max_num_seqs=8, max_model_len=4096,
            kv_cache_memory_bytes=40 << 30, kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
        )  # fmt: skip
        runner = llm.llm_engine.runner
        model, caches = runner.model, runner.layer_caches
        variants = [(sms, prio) for prio in args.attention_priority for sms in args.attention_sms]
        print(f"{'rows':>5s} {'ctx':>5s} {'whole':>9s} {'no attn':>9s} {'ideal':>9s} "
              + " ".join(f"{f's{sms}p{prio}':>9s}" for sms, prio in variants)
              + "   (us a step; sN pP: dbo, N SMs left to attention, its stream at priority P)", flush=True)  # fmt: skip
        for rows in args.rows:
            for ctx in args.contexts:
                inputs = decode_step(model, caches, rows, ctx)

                def step(inputs: tuple[Any, ...] = inputs) -> None:
                    model.forward(*inputs)

                model.step_overlap = None
                whole = timed(step, repeats=10, inner=1) * 1e6
                undo = without_attention(model)
                products = timed(step, repeats=10, inner=1) * 1e6
                undo()
                overlapped = []
                for sms, prio in variants:
                    model.step_overlap, model.dbo_threshold = TorchStreamStepOverlap(0, sms, prio), 2
                    overlapped.append(timed(step, repeats=10, inner=1) * 1e6)
                model.step_overlap = None
                # a perfect overlap hides the smaller of the attention's share and the rest behind the larger
                ideal = max(products, whole - products)
                key = f"rows{rows}_ctx{ctx}"
                result[key] = {"whole_us": whole, "without_attention_us": products, "ideal_us": ideal,
                               **{f"dbo_sms{sms}_prio{prio}_us": t for (sms, prio), t in zip(variants, overlapped)}}  # fmt: skip
                print(f"{rows:5d} {ctx:5d} {whole:9.0f} {products:9.0f} {ideal:9.0f} " + " ".join(f"{t:9.0f}" for t in overlapped)
                      + f"   best {whole / min(overlapped):.3f}x whole", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()

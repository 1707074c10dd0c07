"""Embedding throughput: the engine's ``LLM.embed`` against sentence-transformers on the same model, in one
run (texts/s for ``--num-texts`` texts of ``--text-tokens`` tokens, sentence-transformers at
``--batch-size``), each timed ``--rounds`` times in turn (medians).

The model is a BGE-small-shaped BERT (12 layers, hidden 384, 12 heads; bge-large: ``--large``) with random
weights and sentence-transformers' files (CLS pooling, normalized), saved once under a temporary folder;
its WordPiece tokenizer is built here over a small vocabulary (the weights are random either way).

    python benchmarks/embedding_throughput.py [--dtype float32|bfloat16] [--large]
    python benchmarks/embedding_throughput.py --device cuda --dtype bfloat16 --large --num-texts 4096
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "core", "tests"))


def build(out: str, large: bool) -> str:
    """The model folder (BERT + sentence-transformers' files)."""
    import transformers
    from test_encoders import save_wordpiece_tokenizer

    from engine_test_utils import write_sentence_transformers_files

    save_wordpiece_tokenizer(out)
    sizes = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096) if large else dict(
        hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536
    )  # fmt: skip
    config = transformers.BertConfig(vocab_size=30522, max_position_embeddings=512, **sizes)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(out)
    write_sentence_transformers_files(out, sizes["hidden_size"], "cls_token")
    return out


def texts(n: int, tokens: int) -> list[str]:
    """``n`` different texts of ``tokens`` tokens each (with [CLS] and [SEP]) from the tokenizer's words."""
    words = "the quick brown fox jumps over lazy dog paris is capital of france food was delicious".split()
    return [" ".join(words[(i + j) % len(words)] for j in range(tokens - 2)) for i in range(n)]


def profile_engine(llm: object, batch: list[str], device: str) -> None:
    """One more engine run under cProfile (host functions by own time), then one under torch's profiler
    (device kernels by total time): where a step's time goes beyond the model's arithmetic."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    llm.embed(batch, use_tqdm=False)  # type: ignore[attr-defined]
    if device != "cpu":
        torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device != "cpu":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        llm.embed(batch, use_tqdm=False)  # type: ignore[attr-defined]
        if device != "cpu":
            torch.cuda.synchronize()
    sort = "cuda_time_total" if device != "cpu" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=20))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=25))


def st_child(args: argparse.Namespace) -> None:
    """The child's side of ``--st-process child``: sentence-transformers alone in a fresh process (the heap as
    a user's process has it), one warm-up and one timed run; prints the seconds, saves the embeddings."""
    from sentence_transformers import SentenceTransformer

    path, out = args.st_child
    batch = texts(args.num_texts, args.text_tokens)
    st = SentenceTransformer(path, device=args.device, model_kwargs={"dtype": getattr(torch, args.dtype)})
    st.encode(batch[: args.batch_size], batch_size=args.batch_size)
    started = time.perf_counter()
    embeddings = st.encode(batch, batch_size=args.batch_size, convert_to_tensor=True).float()
    seconds = time.perf_counter() - started
    torch.save(embeddings, out)
    print(json.dumps({"seconds": seconds}))


def run_st_child(args: argparse.Namespace, path: str, out: str) -> float:
    """Seconds of one sentence-transformers run in a child process (see :func:`st_child`)."""
    command = [sys.executable, os.path.abspath(__file__), "--st-child", path, out, "--num-texts", str(args.num_texts),
               "--text-tokens", str(args.text_tokens), "--batch-size", str(args.batch_size), "--dtype", args.dtype,
               "--device", args.device]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-texts", type=int, default=512)
    parser.add_argument("--text-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--large", action="store_true", help="bge-large's shape instead of bge-small's")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both run on it)")
    parser.add_argument("--engine-step-texts", type=int, default=None,
                        help="texts per engine step (its max_num_batched_tokens); default: the engine's own "
                        "budget for encoders on the device (Platform.default_encoder_step_tokens)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each, in turn (medians reported)")
    parser.add_argument("--queue-all", action="store_true",
                        help="queue every text before the first step (as before the engine queued them in chunks)")
    parser.add_argument("--profile", action="store_true",
                        help="also print the engine run's host profile (cProfile) and its device kernels' times")
    parser.add_argument("--out", default=None, help="default benchmarks/results/embedding_throughput_<device>.json")
    parser.add_argument("--st-process", choices=["child", "same"], default=None,
                        help="time sentence-transformers in a child process of its own (the CPU's default: the "
                        "engine's CPU plugin tunes its process's heap, which would speed up a library sharing "
                        "it) or in the engine's process (the GPU's default)")
    parser.add_argument("--st-child", nargs=2, default=None, metavar=("MODEL", "EMBEDDINGS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.st_child:
        st_child(args)
        return
    st_process = args.st_process or ("child" if args.device == "cpu" else "same")
    out_path = args.out or f"benchmarks/results/embedding_throughput_{args.device}.json"

    def now() -> float:
        # the GPU's queued work counts: wait for it before reading the clock
        if args.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter()

    from sentence_transformers import SentenceTransformer

    from engine import LLM

    path = build(tempfile.mkdtemp(prefix="embed-bench-"), args.large)
    batch = texts(args.num_texts, args.text_tokens)
    dtype = getattr(torch, args.dtype)
    st = SentenceTransformer(path, device=args.device, model_kwargs={"dtype": dtype})
    st.encode(batch[: args.batch_size], batch_size=args.batch_size)  # warm-up
    child_out = os.path.join(path, "st_embeddings.pt")
    if args.queue_all:
        LLM.QUEUE_CHUNK = args.num_texts
    step: dict[str, int] = {}
    if args.engine_step_texts is not None:
        step["max_num_batched_tokens"] = args.engine_step_texts * args.text_tokens
    llm = LLM(model=path, device=args.device, dtype=args.dtype, max_num_seqs=max(256, args.engine_step_texts or 0), **step)
    step_tokens = llm.llm_engine.config.scheduler.max_num_batched_tokens
    llm.embed(batch[: 2 * max(1, step_tokens // args.text_tokens)], use_tqdm=False)  # warm-up
    # both in turn, --rounds times (a host's speed moves between runs), each after a full collection
    st_times, engine_times = [], []
    for _ in range(args.rounds):
        gc.collect()
        if st_process == "child":
            st_times.append(run_st_child(args, path, child_out))
            reference = torch.load(child_out)
        else:
            started = now()
            reference = st.encode(batch, batch_size=args.batch_size, convert_to_tensor=True).float()
            st_times.append(now() - started)
        gc.collect()
        started = now()
        outs = llm.embed(batch, use_tqdm=False)
        engine_times.append(now() - started)
    st_s, engine_s = statistics.median(st_times), statistics.median(engine_times)
    shared_heap_s = None
    if st_process == "child":
        # for the record: sentence-transformers in the engine's process, whose heap the engine tuned
        gc.collect()
        started = now()
        st.encode(batch, batch_size=args.batch_size, convert_to_tensor=True)
        shared_heap_s = now() - started
    if args.profile:
        profile_engine(llm, batch, args.device)
    got = torch.stack([o.outputs.data.to(reference.device) for o in outs])
    cosine = torch.nn.functional.cosine_similarity(got.double(), reference.double()).min().item()
    report = {
        "model": "bge-large-shaped BERT" if args.large else "bge-small-shaped BERT", "dtype": args.dtype,
        "device": torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu", "texts": args.num_texts,
        "text_tokens": args.text_tokens, "st_batch_size": args.batch_size, "engine_step_tokens": step_tokens,
        "queued": "all up front" if args.queue_all else f"in chunks of {max(LLM.QUEUE_CHUNK, llm.llm_engine.config.scheduler.max_num_seqs)}",
        "sentence_transformers_texts_per_s": round(args.num_texts / st_s, 1),
        "engine_texts_per_s": round(args.num_texts / engine_s, 1), "ratio": round(st_s / engine_s, 2),
        "rounds": args.rounds, "st_texts_per_s_by_round": [round(args.num_texts / t, 1) for t in st_times],
        "engine_texts_per_s_by_round": [round(args.num_texts / t, 1) for t in engine_times],
        "min_cosine_vs_sentence_transformers": round(cosine, 6), "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "st_process": st_process,
        "st_in_engine_process_texts_per_s": round(args.num_texts / shared_heap_s, 1) if shared_heap_s else None,
    }  # fmt: skip
    print(json.dumps(report, indent=2))
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
